"""Shared by the quantization tests: a tiny Llama config and an fp8 checkpoint writer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from paged_backend.kernels.fp8_types import FP8_DTYPE, FP8_MAX

# a tiny Llama, for checkpoints whose weights a test makes itself
SHAPES = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=128,
              intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: Path, dst: Path, per_channel: bool, scheme: str) -> dict[str, torch.Tensor]:
    """Quantizes every decoder linear of ``src`` to e4m3 (lm_head stays dense); returns the tensors."""
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f".{m}." in name for m in LINEARS):
            amax = t.abs().amax(dim=1, keepdim=True) if per_channel else t.abs().amax()
            scale = (amax.float() / FP8_MAX).clamp_min(1e-12)
            out[name] = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[name.replace(".weight", ".weight_scale")] = scale if per_channel else scale.reshape(())
            if scheme == "static":
                out[name.replace(".weight", ".input_scale")] = torch.tensor(0.01 + 0.001 * len(out))
        else:
            out[name] = t
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme}
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


# -- fp8 mixture-of-experts checkpoints: every decoder linear (attention, dense MLPs, shared and routed
# experts) in e4m3; the routers, embeddings, norms and lm_head stay dense, as the FP8 releases ship them

_MOE_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts\.|experts\.\d+\.)?"
                         r"(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


def fp8_moe_quant_config(fmt: str, num_layers: int, block: tuple[int, int] = (128, 128)) -> dict:
    """config.json's ``quantization_config`` of ``fmt``: "block" (``quant_method: fp8`` with
    ``weight_block_size``, as DeepSeek-V3 / Qwen3-FP8 write it) or "channel" (compressed-tensors
    ``float-quantized``, channel weights and dynamic per-token activations, the routers ignored, as
    zai-org's GLM-4.5-FP8 release reads)."""
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": None}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head", *[f"model.layers.{n}.mlp.gate" for n in range(num_layers + 1)]]}


def quantize_fp8_weight(w: torch.Tensor, fmt: str, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale as the checkpoint stores it, the dequantized float32 weight), written out
    block by block (``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]) or row by row (``weight_scale`` [N, 1])."""
    if fmt == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale, q.float() * scale
    bn, bk = block
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    deq = torch.empty(n, k)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(r * bn, (r + 1) * bn), slice(c * bk, (c + 1) * bk)
            scale[r, c] = (w[rows, cols].abs().max() / FP8_MAX).clamp_min(1e-12)
            q[rows, cols] = (w[rows, cols] / scale[r, c]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            deq[rows, cols] = q[rows, cols].float() * scale[r, c]
    return q, scale, deq


def write_fp8_moe_checkpoint(src: Path, dst: Path, deq_dst: Path, fmt: str, block: tuple[int, int] = (128, 128)
                             ) -> set[str]:
    """Quantizes ``src``'s decoder linears (``_MOE_LINEAR``) to ``fmt`` into ``dst``, and writes the
    dequantized float32 weights into ``deq_dst`` (config.json without a quantization config: what
    transformers runs for the expected tokens). Returns the quantized modules' names."""
    tensors = load_file(src / "model.safetensors")
    out, deq, names = {}, {}, set()
    suffix = "weight_scale_inv" if fmt == "block" else "weight_scale"
    for name, t in tensors.items():
        if _MOE_LINEAR.match(name):
            q, scale, w = quantize_fp8_weight(t, fmt, block)
            out[name], out[name.replace(".weight", f".{suffix}")], deq[name] = q, scale, w
            names.add(name.removesuffix(".weight"))
        else:
            out[name] = deq[name] = t
    cfg = json.loads((src / "config.json").read_text())
    write_quantized_pair(src, dst, deq_dst, out, deq, fp8_moe_quant_config(fmt, cfg["num_hidden_layers"], block))
    return names


def write_quantized_pair(src: Path, dst: Path, deq_dst: Path, out: dict[str, torch.Tensor],
                         deq: dict[str, torch.Tensor], quant_config: dict) -> None:
    """``src``'s checkpoint with tensors ``out`` and ``quant_config`` into ``dst``, and with the dequantized
    ``deq`` and no quantization config into ``deq_dst`` (tokenizer and other files copied to both)."""
    cfg = json.loads((src / "config.json").read_text())
    for folder, weights in ((dst, out), (deq_dst, deq)):
        folder.mkdir(parents=True)
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (folder / f.name).write_bytes(f.read_bytes())
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (deq_dst / "config.json").write_text(json.dumps(cfg))
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant_config}))


# -- int4 mixture-of-experts checkpoints: the same decoder linears in GPTQ or AWQ int4 (asymmetric groups along
# the inputs, fp16 scales), the routers, embeddings, norms and lm_head dense

AWQ_NIBBLES = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's word order: nibble i holds column 8c + AWQ_NIBBLES[i]


def int4_moe_quant_config(fmt: str, group_size: int) -> dict:
    """config.json's ``quantization_config`` of ``fmt``: "gptq" (GPTQModel's keys, v1 zero points, no
    act-order) or "awq" (AutoAWQ GEMM)."""
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq", "lm_head": False}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def quantize_int4_weight(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """[N, K] -> (codes [K, N] 0..15, zero points [G, N] 1..15, fp16 scales [G, N], the dequantized float32
    weight [N, K]): min/max groups of ``group_size`` inputs (zero points kept >= 1: GPTQ v1 stores zero - 1)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1).clamp(max=0.0), groups.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    zero = (-lo / scale.float()).round().clamp(1, 15)
    codes = (groups / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    deq = ((codes - zero[..., None]) * scale.float()[..., None]).reshape(n, k)
    return (codes.reshape(n, k).t().contiguous().to(torch.int32), zero.t().contiguous().to(torch.int32),
            scale.t().contiguous(), deq)


def _pack_rows(v: torch.Tensor) -> torch.Tensor:
    """int [R, C] 0..15 -> int32 [R/8, C]: rows 8r + j in nibble j (GPTQ's qweight)."""
    r, c = v.shape
    parts = v.reshape(r // 8, 8, c).to(torch.int64)
    word = sum(parts[:, j] << (4 * j) for j in range(8))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def _pack_cols(v: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int [R, C] 0..15 -> int32 [R, C/8]: nibble i of word c holds column 8c + order[i]."""
    r, c = v.shape
    parts = v.reshape(r, c // 8, 8).to(torch.int64)
    word = sum(parts[:, :, order[i]] << (4 * i) for i in range(8))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def int4_tensors(name: str, w: torch.Tensor, fmt: str, group_size: int) -> tuple[dict[str, torch.Tensor],
                                                                                 torch.Tensor]:
    """The checkpoint tensors of the linear ``name`` (``...gate_proj.weight``) in ``fmt``, and its dequantized
    float32 weight."""
    codes, zero, scale, deq = quantize_int4_weight(w, group_size)
    base = name.removesuffix(".weight")
    if fmt == "gptq":
        k = codes.shape[0]
        return {f"{base}.qweight": _pack_rows(codes), f"{base}.qzeros": _pack_cols(zero - 1),
                f"{base}.scales": scale, f"{base}.g_idx": (torch.arange(k) // group_size).to(torch.int32)}, deq
    return {f"{base}.qweight": _pack_cols(codes, AWQ_NIBBLES), f"{base}.qzeros": _pack_cols(zero, AWQ_NIBBLES),
            f"{base}.scales": scale}, deq


def write_int4_moe_checkpoint(src: Path, dst: Path, deq_dst: Path, fmt: str, group_size: int) -> None:
    """Quantizes ``src``'s decoder linears (``_MOE_LINEAR``) to int4 in ``fmt`` into ``dst``, and writes the
    dequantized float32 weights into ``deq_dst`` (no quantization config: what transformers runs)."""
    tensors = load_file(src / "model.safetensors")
    out, deq = {}, {}
    for name, t in tensors.items():
        if _MOE_LINEAR.match(name):
            packed, deq[name] = int4_tensors(name, t, fmt, group_size)
            out.update(packed)
        else:
            out[name] = deq[name] = t
    write_quantized_pair(src, dst, deq_dst, out, deq, int4_moe_quant_config(fmt, group_size))
