"""The tool-made checkpoints of tests/quant_checkpoints/ on CUDA (skipped without a GPU): every
quantized layer through the GPU path (Triton int4 kernel, ``torch._scaled_mm`` for fp8) agrees
with the CPU path, and the engine on the GPU reproduces the tools' greedy tokens. float32, so
the int4 kernel's tl.dot runs in full precision (not TF32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_backend.attention import get_attention_backend
from paged_backend.model_info import ModelInfo
from paged_backend.model_loader import load_model
from paged_backend.models.layers import FusedLinear

ROOT = Path(__file__).parent / "quant_checkpoints"
CHECKPOINTS = sorted(p.name for p in ROOT.iterdir() if (p / "reference.pt").is_file()) if ROOT.is_dir() else []
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _load(path: Path, device: str):
    info = ModelInfo.from_dir(path)
    return load_model(path, info, torch.float32, device, get_attention_backend("torch", torch.device(device)))


@pytest.mark.parametrize("name", CHECKPOINTS)
@torch.no_grad()
def test_gpu_layers_match_the_cpu_path(name):
    cpu, gpu = _load(ROOT / name, "cpu"), _load(ROOT / name, "cuda")
    pairs = [(n, m, dict(gpu.named_modules())[n]) for n, m in cpu.named_modules()
             if isinstance(m, FusedLinear) and m.linear_method is not None]
    assert pairs
    gen = torch.Generator().manual_seed(0)
    for n, c, g in pairs:
        x = torch.randn(7, c.in_features, generator=gen)
        want, got = c(x), g(x.cuda()).cpu()
        if name.startswith("ct-fp8"):  # same e4m3 codes, fp32 sums in another order
            assert getattr(g, "fp8_scale_row", None) is not None, n  # the _scaled_mm path was taken
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{name} {n}: {m}")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_tokens_match_the_tools_on_the_gpu(name):
    from paged_backend import LLM
    from paged_backend.sampling_params import SamplingParams

    ref = torch.load(ROOT / name / "reference.pt")
    llm = LLM(model=str(ROOT / name), dtype="float32", device="cuda", attention_backend="torch",
              kv_cache_memory_bytes=1 << 24, max_num_seqs=8, disable_log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=len(ref["refs"][0]["greedy"]), ignore_eos=True)
    outs = llm.generate([r["prompt_ids"] for r in ref["refs"]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r["greedy"] for r in ref["refs"]]
