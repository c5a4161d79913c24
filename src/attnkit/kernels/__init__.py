"""Attention kernels: ``reference`` (the plain formula) and ``dispatch`` (which runs)."""
