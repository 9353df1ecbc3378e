"""The Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3, GLM-4, DeepSeek-V2/V3 and the MoE kin) over a
paged KV cache.

vLLM style: the step's tokens are flattened (no batch dim); the attention backend writes
the new K/V into ``kv_caches[layer]`` and attends through ``meta``'s block tables. The op
order follows transformers' LlamaModel so fp32 logits agree with HF's.

    embed -> [ input_norm(+res) -> attn -> post_attn_norm(+res) -> mlp ] x L -> norm(+res)
    attn:  qkv_proj -> (Qwen3, GLM-4.5: q_norm/k_norm per head) -> rope -> backend -> o_proj
           (DeepSeek: multi-head latent attention over a latent cache, models/mla.py)
    mlp:   LlamaMLP, or SparseMoeBlock on routed layers (router -> experts; + shared experts, GLM-4.5)
    GLM-4-0414: attn -> post_self_attn_norm and mlp -> post_mlp_norm before their residual adds
    rope:  neox halves, or interleaved pairs (GLM, GLM-4); the first rotary_dim dims (partial: the GLMs)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.attention.backend import AttentionBackend, AttentionMetadata
from paged_backend.kernels.fp8_types import FP8_MAX
from paged_backend.models.cpu_linear import PACKED, cpu_linear, dense_on_cpu, linear
from paged_backend.models.layers import (
    ModelOps,
    RMSNorm,
    RotaryEmbedding,
    reference_ops,
    register_kv_scales,
    reset_kv_scales,
)
from paged_backend.models.mla import DEQUANTIZED_KV_B, MLAAttention
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.moe import SparseMoeBlock
from paged_backend.models.parallel import (
    down_proj,
    embed_tokens,
    gate_up_proj,
    lm_head,
    local_heads,
    o_proj,
    qkv_proj,
)
from paged_backend.models.weight_loading import checkpoint_names, load_checkpoint_tensors, stage_weights

if TYPE_CHECKING:
    from paged_backend.distributed import PPStage, TPGroup

class LlamaAttention(nn.Module):
    def __init__(
        self,
        info: ModelInfo,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        ops: ModelOps,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = info.head_dim
        self.num_heads, self.num_kv_heads = local_heads(info, tp)  # this rank's heads (all without TP)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = qkv_proj(info, dtype, tp)  # column-parallel under TP
        self.o_proj = o_proj(info, dtype, tp)  # row-parallel under TP (all-reduce)
        self.q_norm = RMSNorm(self.head_dim, info.rms_norm_eps, dtype, ops) if info.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, info.rms_norm_eps, dtype, ops) if info.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn_backend = attn_backend
        self.scale = self.head_dim**-0.5
        self.sliding_window = info.layer_sliding_windows[layer_idx]
        register_kv_scales(self)

    def init_buffers(self) -> None:
        reset_kv_scales(self)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = linear(self.qkv_proj, hidden).split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(k.shape)
        # where the attention kernel takes q pre-scaled (prefill), the rotary kernel folds that in
        q_scale = self.attn_backend.query_scale(q, kv_cache, meta, self.scale)
        q, k = self.rotary_emb(positions, q, k, q_scale)
        if self.calibrate_kv_scales and t > 0:
            # fp8 e4m3 holds +-448: scale so the first batch's largest |K| / |V| fits exactly
            self.k_scale.copy_(k.detach().abs().amax().float().clamp_min(1e-6) / FP8_MAX)
            self.v_scale.copy_(v.detach().abs().amax().float().clamp_min(1e-6) / FP8_MAX)
            self.calibrate_kv_scales = False
        if meta.sliding_window != self.sliding_window:
            meta = replace(meta, sliding_window=self.sliding_window)
        o = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale,
                                      q_scaled=q_scale is not None)
        return linear(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """The dense MLP, of ``intermediate_size`` features (default: the model's; GLM-4.5's shared experts)."""

    def __init__(self, info: ModelInfo, dtype: torch.dtype, ops: ModelOps, tp: TPGroup | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj(info, dtype, tp, intermediate_size)
        self.down_proj = down_proj(info, dtype, tp, intermediate_size)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if dense_on_cpu(gate_up, x):
            # on the CPU two [*, I] matmuls beat one [*, 2I] (~10% of the MLP at 32 and 1024 rows, MKL
            # and oneDNN alike) and silu then reads contiguous halves; the math of silu_and_mul
            i = gate_up.weight.shape[0] // 2
            gate = cpu_linear(gate_up, x, (0, i))
            up = cpu_linear(gate_up, x, (i, 2 * i))
            return linear(self.down_proj, F.silu(gate, inplace=True).mul_(up))
        return linear(self.down_proj, self.ops.silu_and_mul(gate_up(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        info: ModelInfo,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        ops: ModelOps,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        attention = MLAAttention if info.mla is not None else LlamaAttention  # DeepSeek: latent attention
        self.self_attn = attention(info, layer_idx, rotary_emb, attn_backend, dtype, ops, tp)
        self.mlp: nn.Module
        if info.moe_layers and info.moe_layers[layer_idx]:
            assert info.routing is not None
            shared = info.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(info.routing, info.hidden_size, info.moe_intermediate_size, dtype, tp,
                                      moe_op=ops.fused_moe,
                                      shared_experts=LlamaMLP(info, dtype, ops, tp, shared) if shared else None)
        else:
            self.mlp = LlamaMLP(info, dtype, ops, tp)
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, ops)
        # GLM-4-0414: each sublayer's output normed before its residual add
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if info.sublayer_output_norms:
            self.post_self_attn_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, ops)
            self.post_mlp_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (mlp output, residual): the residual add is fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden, _ = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.post_self_attn_layernorm is not None:
            hidden, _ = self.post_self_attn_layernorm(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.post_mlp_layernorm is not None:
            hidden, _ = self.post_mlp_layernorm(hidden)
        return hidden, residual


class LlamaModel(nn.Module):
    """Under pipeline parallelism (``pp``) only the stage's layers are built (the others are parameterless
    placeholders, so parameter names keep their global layer index); the embedding on the first stage
    (and on a last stage whose LM head is tied to it), the final norm on the last."""

    def __init__(self, info: ModelInfo, attn_backend: AttentionBackend, dtype: torch.dtype, ops: ModelOps,
                 tp: TPGroup | None = None, pp: PPStage | None = None) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(
            info.head_dim, info.max_position_embeddings, info.rope_theta, info.rope_scaling, ops, info.rope_dim,
            interleaved=info.rope_interleaved,
        )
        start, end = (0, info.num_layers) if pp is None else (pp.start, pp.end)
        first, last = pp is None or pp.is_first, pp is None or pp.is_last
        embeds = first or (last and info.tie_word_embeddings)
        self.embed_tokens = embed_tokens(info, dtype, tp) if embeds else None  # vocab-parallel under TP
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(info, i, self.rotary_emb, attn_backend, dtype, ops, tp) if start <= i < end
            else nn.Identity() for i in range(info.num_layers)
        )
        self.local_layers = list(self.layers)[start:end]  # kv_caches[i] is local_layers[i]'s
        self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, ops) if last else None

    # speculative decoding's MTP layers (models/mtp.py) read the last hidden states before the final norm
    keep_prenorm = False
    prenorm: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:  # a later pipeline stage: the previous stage's (hidden, residual)
            hidden, residual = intermediate
        for i, layer in enumerate(self.local_layers):
            hidden, residual = layer(positions, hidden, residual, kv_caches[i], meta)
        if self.norm is None:  # a pipeline stage before the last: the next stage's input
            return hidden, residual
        hidden, prenorm = self.norm(hidden, residual)
        if self.keep_prenorm:
            self.prenorm = prenorm
        return hidden


class LlamaForCausalLM(nn.Module):
    """One class for the Llama family; ModelInfo's flags select biases, norms, the rotary layout and windows."""

    def __init__(
        self,
        info: ModelInfo,
        attn_backend: AttentionBackend,
        dtype: torch.dtype,
        ops: ModelOps | None = None,
        tp: TPGroup | None = None,
        pp: PPStage | None = None,
    ) -> None:
        super().__init__()
        self.info = info
        self.tp = tp  # tensor parallelism: this rank's group (None: the whole model)
        self.pp = pp  # pipeline parallelism: this rank's stage (None: every layer here)
        self.dtype = dtype
        self.ops = ops or reference_ops()
        self.model = LlamaModel(info, attn_backend, dtype, self.ops, tp, pp)
        # under TP: logits gathered to the stage's first rank; under PP: on the last stage only
        self.lm_head = lm_head(info, dtype, tp) if pp is None or pp.is_last else None
        if info.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def sliding_window(self) -> int | None:
        """The largest window any layer uses (None = full attention everywhere)."""
        return self.info.sliding_window

    def init_buffers(self) -> None:
        """Recomputes non-persistent buffers (rope table, KV scales) after ``to_empty``."""
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,  # PP: the previous stage's output
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, hidden], final-normed; PP: (hidden, residual)
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> float32 [N, vocab]
        return linear(self.lm_head, hidden).float()

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The HF tensor names that load ``param_name`` (several for a fused parameter)."""
        return checkpoint_names(param_name, self.info)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors through each parameter's ``weight_loader`` (models/weight_loading.py);
        returns the names of the fully loaded parameters and KV-scale buffers."""
        for m in self.modules():  # copies made from the old weights (cpu_linear's packed ones, MLA's dequantized)
            m.__dict__.pop(PACKED, None)
            m.__dict__.pop(DEQUANTIZED_KV_B, None)
        if self.pp is not None:
            weights = stage_weights(self.info, self.pp, weights)
        return load_checkpoint_tensors(self, self.info, weights)
