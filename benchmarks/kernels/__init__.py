"""Kernel micro-benches: Strata's CUDA kernels timed alone against MLX's and cuDNN's (each needs
MLX's CUDA backend, except ``pass_kernels.py --summarize``)."""
