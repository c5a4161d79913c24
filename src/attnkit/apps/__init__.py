"""What each ``attnkit`` command does, as library code: running a model, drawing its attention,
training it. :mod:`attnkit.cli` parses the arguments, calls one ``run`` here and reports errors.

- :mod:`~attnkit.apps.show`: a model's attention on a text (MiniLM, RecallLM, a checkpoint);
- :mod:`~attnkit.apps.translate`, :mod:`~attnkit.apps.caption`, :mod:`~attnkit.apps.listen`,
  :mod:`~attnkit.apps.recommend`: the four applications with their figures and pages;
- :mod:`~attnkit.apps.train`: training any shipped model.
"""
