"""The PyTorch engines' walk of a plan: the ``fused`` and ``math`` kernels, one exact attention call
per run of key blocks, merged by log-sum-exp (:mod:`~attnkit.kernels.runs.walk`), their engines,
the run's tensors (:mod:`~attnkit.kernels.runs.tiles`), their custom ops under ``torch.compile``
(:mod:`~attnkit.kernels.runs.compiled`) and the tile-by-tile statistics
(:mod:`~attnkit.kernels.runs.stats`)."""
