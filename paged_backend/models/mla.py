"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Checkpoint modules under ``model.layers.N.self_attn`` (transformers' names, kept as ours)::

    q_proj [H * (nope + rope), hidden]                       (q_lora_rank null: V2, V2-Lite)
    or q_a_proj [q_lora, hidden] -> q_a_layernorm -> q_b_proj [H * (nope + rope), q_lora]   (V3)
    kv_a_proj_with_mqa [kv_lora + rope, hidden]   -> c [kv_lora] (kv_a_layernorm), k_pe [rope] (one head)
    kv_b_proj [H * (nope + v), kv_lora]           per head: W_UK [nope, kv_lora] rows, then W_UV [v, kv_lora]
    o_proj [hidden, H * v]

Per token the cache keeps [ kv_a_layernorm(c) | rope(k_pe) ] (``MLAInfo.latent_dim`` values), and the
attention is the absorbed form (``paged_backend/kernels/mla_attention_ref.py``)::

    q_lat = q_nope @ W_UK          per head [kv_lora]
    o_lat = MQA(scale, [q_lat | rope(q_pe)], latent)        value = the latent's first kv_lora dims
    out   = o_proj(o_lat @ W_UV.T)

equal to transformers' decompressed form (k_nope = W_UK c, v = W_UV c per head) up to summation order.
RoPE turns adjacent pairs of the rope dims (DeepSeek's interleaved layout); the scale is
``MLAInfo.softmax_scale``. Tensor parallelism splits the heads (q_proj / q_b_proj and kv_b_proj
column-parallel, o_proj row-parallel); q_a_proj, kv_a_proj_with_mqa and the latent cache are whole on
every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_backend.attention.backend import AttentionBackend, AttentionMetadata
from paged_backend.models.cpu_linear import linear
from paged_backend.models.layers import (
    FusedLinear,
    ModelOps,
    RMSNorm,
    RotaryEmbedding,
    register_kv_scales,
    reset_kv_scales,
)
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.parallel import ColumnParallelLinear, RowParallelLinear, split

if TYPE_CHECKING:
    from paged_backend.distributed import TPGroup

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps
DEQUANTIZED_KV_B = "_kv_b_dense"  # module attribute: a quantized kv_b_proj's dequantized weight (load_weights drops it)


def _column(in_features: int, out_features: int, dtype: torch.dtype, tp: TPGroup | None, what: str) -> FusedLinear:
    if tp is None:
        return FusedLinear(in_features, (out_features,), False, dtype)
    return ColumnParallelLinear(in_features, [split(out_features, tp, what)], False, dtype, tp)


class MLAAttention(nn.Module):
    """One layer's latent attention; ``forward`` as ``LlamaAttention.forward`` (the cache is the latent one)."""

    def __init__(self, info: ModelInfo, layer_idx: int, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 dtype: torch.dtype, ops: ModelOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        mla = info.mla
        assert mla is not None
        self.mla = mla
        self.layer_idx = layer_idx
        self.num_heads = info.num_heads if tp is None else split(info.num_heads, tp, "num_attention_heads")[1]
        heads, hidden = info.num_heads, info.hidden_size
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = _column(hidden, heads * mla.qk_head_dim, dtype, tp, "num_attention_heads")
        else:
            self.q_a_proj = FusedLinear(hidden, (mla.q_lora_rank,), info.attention_bias, dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype, ops)
            self.q_b_proj = _column(mla.q_lora_rank, heads * mla.qk_head_dim, dtype, tp, "num_attention_heads")
        self.kv_a_proj_with_mqa = FusedLinear(hidden, (mla.latent_dim,), info.attention_bias, dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype, ops)
        self.kv_b_proj = _column(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), dtype, tp,
                                 "num_attention_heads")
        if tp is None:
            self.o_proj = FusedLinear(heads * mla.v_head_dim, (hidden,), info.attention_bias, dtype)
        else:
            self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, info.attention_bias, dtype, tp)
        self.rotary_emb = rotary_emb
        self.attn_backend = attn_backend
        self.scale = mla.softmax_scale
        register_kv_scales(self)  # k_scale: the fp8 latent cache's scale (v_scale unused)

    def init_buffers(self) -> None:
        reset_kv_scales(self)

    def _absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]) of this rank's heads: views of kv_b_proj's weight, or
        of a quantized kv_b_proj's dequantized weight (its method applied to the identity, made once: e4m3
        activations of one-hot rows are exact, so this is the checkpoint's own dequantized values)."""
        m = self.mla
        if self.kv_b_proj.linear_method is None:
            w = self.kv_b_proj.weight
        else:
            w = self.__dict__.get(DEQUANTIZED_KV_B)
            if w is None or w.dtype != dtype:
                eye = torch.eye(m.kv_lora_rank, dtype=dtype, device=self.k_scale.device)
                with torch.no_grad():
                    w = self.kv_b_proj.linear_method.apply(self.kv_b_proj, eye).t().contiguous()
                self.__dict__[DEQUANTIZED_KV_B] = w
        w = w.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        m, t = self.mla, hidden.shape[0]
        if self.q_proj is not None:
            q = linear(self.q_proj, hidden)
        else:
            q = linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, hidden))[0])
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = linear(self.kv_a_proj_with_mqa, hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        c = self.kv_a_layernorm(c.contiguous())[0]
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.reshape(t, 1, m.qk_rope_head_dim).contiguous())
        if self.calibrate_kv_scales and t > 0:  # fp8 latent cache: the first batch's largest |value| -> 448
            from paged_backend.kernels.fp8_types import FP8_MAX

            amax = torch.maximum(c.detach().abs().amax(), k_pe.detach().abs().amax()).float()
            self.k_scale.copy_(amax.clamp_min(1e-6) / FP8_MAX)
            self.calibrate_kv_scales = False
        w_uk, w_uv = self._absorbed(q_nope.dtype)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe], dim=-1)
        latent = torch.cat([c, k_pe.reshape(t, m.qk_rope_head_dim)], dim=-1)
        o_lat = self.attn_backend.forward_mla(query, latent, kv_cache, meta, self.scale, m.kv_lora_rank, self.k_scale)
        o = torch.einsum("thl,hvl->thv", o_lat, w_uv)
        return linear(self.o_proj, o.reshape(t, self.num_heads * m.v_head_dim))
