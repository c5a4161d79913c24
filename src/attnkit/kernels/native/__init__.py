"""The ``native`` kernel: attnkit's C++ engine (``csrc/``, one translation unit of stage headers),
built and loaded by :mod:`attnkit.kernels.native.build`, run by :mod:`attnkit.kernels.native.kernel`."""
