"""Benchmarks behind ``paged-backend bench``: throughput, serving, kernels, quantization, peers."""
