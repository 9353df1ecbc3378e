"""Triton model: the paged-backend engine behind vllm_backend's inputs and outputs."""

from paged_backend.adapters.triton_backend import TritonPythonModel

__all__ = ["TritonPythonModel"]
