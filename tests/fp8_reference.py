"""transformers as the reference of an FP8 checkpoint on the CPU: the dequantized weights, every quantized linear's
input fake-quantized as the engine quantizes it (per token, and per group of ``bk`` inputs for block scales), greedy
by full recompute; and ``FollowsTransformers``, the token comparison that allows e4m3 rounding flips
(test_moe_fp8_models.py's module docstring says why). Import from tests as ``fp8_reference``."""

from __future__ import annotations

from pathlib import Path

import torch
from family_fixtures import PROMPTS

from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX

BK = 128
FLIP_MARGIN = 0.1  # logits; the fixed MoE checkpoints diverge twice in 30 runs, by 0.016 and 0.029


class FollowsTransformers(list):
    """transformers' greedy tokens per prompt, equal to engine tokens that follow them up to rounding flips
    (module docstring). A list subclass: ``engine_tokens == expected`` in the shared family checks calls
    this ``__eq__``."""

    def __init__(self, tokens: list[list[int]], hf) -> None:
        super().__init__(tokens)
        self.hf = hf

    __hash__ = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list) or len(other) != len(self):
            return False
        whole = 0
        for prompt, want, have in zip(PROMPTS, self, other, strict=True):
            if list(have) == want:
                whole += 1
                continue
            if len(have) != len(want):
                return False
            t = next(i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b)
            with torch.no_grad():
                logits = self.hf(torch.tensor([prompt + want[:t]])).logits[0, -1]
            if float(logits[want[t]] - logits[have[t]]) >= FLIP_MARGIN:
                return False
        return whole >= len(self) // 2


def fake_quant(x: torch.Tensor, fmt: str, bk: int = BK) -> torch.Tensor:
    """e4m3 round trip of a linear's input as the format's checkpoints run it, written out group by group."""
    groups = [x] if fmt == "channel" else list(x.split(bk, dim=-1))
    out = []
    for part in groups:
        scale = part.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
        out.append(((part.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype))
    return torch.cat(out, dim=-1)


def fake_quant_hf(deq: Path, quantized: set[str], fmt: str, bk: int = BK):
    """transformers on the dequantized checkpoint, every quantized linear's input fake-quantized."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager",
                                              experts_implementation="eager").eval()
    # transformers holds every family's experts under ``mlp`` (Mixtral's checkpoint: ``block_sparse_moe``)
    experts = {n.rsplit(".", 2)[0].replace(".block_sparse_moe.", ".mlp.") for n in quantized if ".experts." in n}
    for name, module in hf.named_modules():
        if name in quantized:
            assert isinstance(module, torch.nn.Linear), name
            module.register_forward_pre_hook(lambda _, args: (fake_quant(args[0], fmt, bk), *args[1:]))
        elif name in experts:
            module.forward = _quantized_inputs(module.forward, fmt, bk)
    assert all(any(n == e for n, _ in hf.named_modules()) for e in experts)
    return hf


def _quantized_inputs(forward, fmt: str, bk: int):
    """``forward`` with every ``F.linear`` inside it fed the fake-quantized input (the eager experts)."""

    def wrapped(*args, **kwargs):
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = lambda x, w, b=None: linear(fake_quant(x, fmt, bk), w, b)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = linear

    return wrapped
