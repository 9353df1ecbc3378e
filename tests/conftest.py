"""Test-session setup shared by all tests.

Triton kernels run under ``TRITON_INTERPRET=1`` on machines without CUDA (CI). The flag
is read when a kernel is decorated, so it is set here, before any kernel module is
imported (the engine imports kernels lazily). The interpreter's float converter rounds
wrongly into fp8/bf16 (no carry into the exponent, ties not to even, bf16 truncated), so
conversions touching those types go through torch's own casts: bit-exact with torch.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter_float_converter() -> None:
    """Route the interpreter's bf16/fp8 conversions through torch (round to nearest even)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_paged_backend_patched", False):
        return  # another Triton layout: the fp8 tests then show whether it still rounds right
    torch_dtypes = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    special = (tl.bfloat16, tl.float8e4nv, tl.float8e5)
    bits = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
    np_bits = {8: np.uint8, 16: np.uint16, 32: np.uint32}

    def convert(input, input_dtype, output_dtype, rounding_mode):  # noqa: A002 - interpreter's names
        rtz = rounding_mode is not None and rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ
        if (
            rtz
            or input_dtype not in torch_dtypes
            or output_dtype not in torch_dtypes
            or (input_dtype not in special and output_dtype not in special)
        ):
            return original(input, input_dtype, output_dtype, rounding_mode)
        arr = np.ascontiguousarray(input)
        width_in = input_dtype.primitive_bitwidth
        raw = torch.from_numpy(arr.view(np_bits[width_in]).astype(np.int64)).to(bits[width_in])
        x = raw.view(torch_dtypes[input_dtype])
        y = x.to(torch_dtypes[output_dtype])
        width_out = output_dtype.primitive_bitwidth
        out = y.view(bits[width_out]).numpy().view(np_bits[width_out])
        return out.reshape(np.shape(input))

    convert._paged_backend_patched = True
    interpreter._convert_float = convert


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _patch_interpreter_float_converter()


@pytest.fixture
def poison_uninitialized():
    """Make ``torch.empty`` return NaN-filled memory, so any element a kernel leaves unwritten shows."""
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(prev, warn_only=True)


@pytest.fixture(scope="module")
def llm():
    """An fp32 CPU engine on the real SmolLM2, shared by the tests of one module."""
    from smollm2 import make_llm

    return make_llm()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped on a machine without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
