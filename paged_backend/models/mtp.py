"""Multi-token-prediction (MTP) layers (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers``) as a speculative
decoding proposer.

MTP layer i is stored after the L decoder layers, as ``model.layers.{L + i}``; here it is ``mtp.layers.{i}`` of the
model (``models/weight_loading.py`` maps the names both ways)::

    enorm.weight, hnorm.weight           RMSNorms of the token embedding and of the previous hidden state
    eh_proj.weight [hidden, 2 * hidden]  the embedding part first
    self_attn.*, mlp.*, input_layernorm, post_attention_layernorm
                                         a decoder layer of the model's kind (routed experts when the model has
                                         them), with its own KV cache (one more cache layer over the same blocks)
    shared_head.norm.weight, shared_head.head.weight
                                         (a checkpoint without the head: the model's LM head, as GLM-4.6's)
    embed_tokens.weight                  when stored, a copy of the model's: not loaded, the model's is used

For position i, with h_i the model's last hidden state there before its final norm and t_{i+1} the next token::

    e = embed(t_{i+1}), zero at position 0     (vLLM's deepseek_mtp masks position 0 the same way)
    x = eh_proj(cat([enorm(e), hnorm(h_i)]))
    y = block(x)                               the decoder layer, residual added back: its hidden state
    logits(t_{i+2}) = shared_head.head(shared_head.norm(y))

For more drafts than layers the layers are reused in turn, each fed the previous pass's ``y`` (vLLM's order).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_backend.attention.backend import AttentionBackend, AttentionMetadata
from paged_backend.models.cpu_linear import linear
from paged_backend.models.layers import FusedLinear, ModelOps, RMSNorm, RotaryEmbedding
from paged_backend.models.llama import LlamaDecoderLayer
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.parallel import lm_head

if TYPE_CHECKING:
    from paged_backend.distributed import TPGroup

# an MTP layer's linears that quantized checkpoints store unquantized (its decoder block is quantized as the model's)
UNQUANTIZED_MTP_LINEARS = (".eh_proj", ".shared_head.head")


class SharedHead(nn.Module):
    def __init__(self, info: ModelInfo, dtype: torch.dtype, ops: ModelOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, ops)
        self.head = lm_head(info, dtype, tp)  # as the model's: vocabulary rows per rank, logits gathered to rank 0


class MTPLayer(LlamaDecoderLayer):
    """One MTP layer: the decoder layer of index ``L + i`` plus its input projection and output head."""

    def __init__(self, info: ModelInfo, layer_idx: int, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 dtype: torch.dtype, ops: ModelOps, tp: TPGroup | None = None) -> None:
        super().__init__(info, layer_idx, rotary_emb, attn_backend, dtype, ops, tp)  # its block split as the model's
        hidden = info.hidden_size
        self.enorm = RMSNorm(hidden, info.rms_norm_eps, dtype, ops)
        self.hnorm = RMSNorm(hidden, info.rms_norm_eps, dtype, ops)
        self.eh_proj = FusedLinear(2 * hidden, (hidden,), False, dtype)  # whole on every rank (vLLM's replicated)
        self.shared_head = SharedHead(info, dtype, ops, tp)

    def predict(self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's hidden state [T, hidden] (before ``shared_head.norm``)."""
        embeds = torch.where((positions == 0)[:, None], torch.zeros((), dtype=embeds.dtype, device=embeds.device),
                             embeds)
        x = linear(self.eh_proj, torch.cat([self.enorm(embeds)[0], self.hnorm(prev_hidden)[0]], dim=-1))
        hidden, residual = self.forward(positions, x, None, kv_cache, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [N, vocab]; under tensor parallelism [N, 0] on ranks > 0 (the logits go to rank 0)."""
        return linear(self.shared_head.head, self.shared_head.norm(hidden)[0]).float()


class MultiTokenPredictor(nn.Module):
    """The checkpoint's MTP layers; the model's token embedding (``embed``, not a parameter of this module)."""

    def __init__(self, info: ModelInfo, attn_backend: AttentionBackend, dtype: torch.dtype, ops: ModelOps,
                 rotary_emb: RotaryEmbedding, embed: nn.Module, tp: TPGroup | None = None) -> None:
        """``tp``: the model's group; the layers split as its decoder layers and head do."""
        super().__init__()
        n = info.num_mtp_layers
        if n <= 0:
            raise ValueError("the checkpoint has no multi-token-prediction layers (num_nextn_predict_layers)")
        self.num_layers = n
        # the MTP layers' indices L .. L + n - 1: routed experts when the model routes, full attention
        layer_info = replace(info, moe_layers=info.moe_layers + (info.is_moe,) * n if info.moe_layers else (),
                             layer_sliding_windows=info.layer_sliding_windows + (None,) * n)
        self.layers = nn.ModuleList(MTPLayer(layer_info, info.num_layers + i, rotary_emb, attn_backend, dtype, ops,
                                             tp) for i in range(n))
        self.__dict__["embed"] = embed  # shared with the model: not registered twice

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata, spec_step: int = 0) -> torch.Tensor:
        """Draft pass ``spec_step`` (layer ``spec_step % n``): tokens t_{i+1} at positions i with the hidden
        states h_i; returns the layer's hidden states [T, hidden]."""
        i = spec_step % self.num_layers
        return self.layers[i].predict(positions, self.embed(input_ids), prev_hidden, kv_caches[i], meta)

    def compute_logits(self, hidden: torch.Tensor, spec_step: int = 0) -> torch.Tensor:
        """float32 [N, vocab]: the logits of the token after the next."""
        return self.layers[spec_step % self.num_layers].compute_logits(hidden)

    def share_missing_heads(self, loaded: set[str], lm_head: nn.Module) -> None:
        """A layer whose checkpoint has no ``shared_head.head`` (GLM-4.6 stores none) uses the model's LM head."""
        for i, layer in enumerate(self.layers):
            if f"mtp.layers.{i}.shared_head.head.weight" not in loaded:
                layer.shared_head.head = lm_head
