"""The ``triton`` kernel: block-sparse FlashAttention-2 in Triton for CUDA (:mod:`~attnkit.kernels.triton.kernel`),
its programs (:mod:`~attnkit.kernels.triton.jit`) and whether Triton is here (:mod:`~attnkit.kernels.triton.env`)."""
