"""Kernels: each family is a Triton kernel (``<family>.py``) beside its pure-torch
reference (``<family>_ref.py``). The references are also the CPU path.

Installed as ``paged_backend.kernels`` (the top-level name ``kernels`` belongs to a
Hugging Face package); always import it under that name.
"""
