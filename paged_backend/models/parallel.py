"""Megatron-style tensor-parallel layers, and the weight slicing every loader shares.

Each rank holds a slice of each linear; checkpoint tensors stay whole in the files and each
rank reads only its slice (``LazyTensor`` wraps safetensors' mmap ``get_slice``)::

    column-parallel (q|k|v, gate|up)   W [out, in]: every shard's rows split over ranks,
                                       output stays split (no communication)
    row-parallel    (o, down)          W [out, in]: columns split; y = all_reduce(x_r @ W_r.T) + b
    vocab-parallel  (embed, lm_head)   rows [r*Vp, (r+1)*Vp) (the last rank zero-padded);
                                       embed all-reduces, lm_head gathers logits to rank 0

KV heads: ``Hkv >= tp``: Hkv/tp heads per rank; ``Hkv < tp`` (tp % Hkv == 0): each rank
holds one KV head, head ``r * Hkv // tp``, which is the one its q heads attend to.

Routed experts (``models/moe.py``): every expert's intermediate features split over the ranks, or
with expert parallelism (``TPGroup.expert_parallel``) whole experts per rank, ``expert_range``.

With ``tp=None`` the factories return the plain single-device layers (``FusedLinear``,
``Embedding``), so a tensor_parallel_size == 1 model is exactly what it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_backend.models.layers import Embedding, FusedLinear, ShardId, new_param
from paged_backend.models.model_info import ModelInfo

if TYPE_CHECKING:
    from paged_backend.distributed import TPGroup
    from paged_backend.models.linear_method import LinearMethod


# -- lazily read checkpoint tensors --------------------------------------------------------


class LazyTensor:
    """A checkpoint tensor not yet read: ``narrow`` reads one slice from the mmap'ed file.

    Anything else (``.reshape``, ``.numel()``, ``dst.copy_(t)``, ``torch.*``) reads the whole
    tensor, so loaders that know nothing of TP (replicated norms, scales) work unchanged.
    """

    def __init__(self, safe_slice: Any) -> None:
        self._slice = safe_slice
        self.shape = torch.Size(safe_slice.get_shape())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % self.ndim
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def full(self) -> torch.Tensor:
        return self._slice[...]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.full(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(a: Any) -> Any:
            if isinstance(a, LazyTensor):
                return a.full()
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})


def as_tensor(t: torch.Tensor | LazyTensor) -> torch.Tensor:
    return t.full() if isinstance(t, LazyTensor) else t


def narrow(t: torch.Tensor | LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``t.narrow`` that reads only the slice of a ``LazyTensor``; clear error when out of range."""
    size = t.shape[dim]
    if start < 0 or start + length > size:
        raise ValueError(f"shape mismatch: checkpoint dim {dim} has {size}, this rank needs "
                         f"[{start}, {start + length})")
    return t.narrow(dim, start, length)


# -- which slice a rank holds ----------------------------------------------------------------


@dataclass(frozen=True)
class TPSpec:
    """How a layer is split: ``column``: per shard (start, size) in output features of the full
    tensor; ``row``: (start, size) in input features; ``vocab``: (start, valid rows)."""

    kind: str  # "column" | "row" | "vocab"
    out_ranges: dict[ShardId | None, tuple[int, int]] = field(default_factory=dict)
    in_range: tuple[int, int] | None = None


def shard_for_rank(
    layer: nn.Module,
    loaded: torch.Tensor | LazyTensor,
    shard_id: ShardId | None = None,
    *,
    out_dim: int | None = None,
    in_dim: int | None = None,
    out_pack: int = 1,
    in_pack: int = 1,
) -> torch.Tensor:
    """The part of checkpoint tensor ``loaded`` that this rank's ``layer`` holds.

    ``out_dim`` / ``in_dim``: the tensor's dim along output / input features (None: the tensor
    does not run along it, e.g. a per-tensor scale, or a row-parallel bias: read whole).
    ``*_pack``: features per element along that dim (8 for int4 packed in int32, group_size
    for group-wise scales). A layer without ``tp_spec`` (no TP) gets the whole tensor.
    """
    spec: TPSpec | None = getattr(layer, "tp_spec", None)
    if spec is None:
        return as_tensor(loaded)
    if spec.kind in ("column", "vocab") and out_dim is not None:
        start, size = spec.out_ranges[shard_id]
        if start % out_pack or size % out_pack:
            raise ValueError(f"shard {shard_id!r}: this rank's {size} output features at {start} are not a "
                             f"multiple of the packing ({out_pack})")
        return narrow(loaded, out_dim, start // out_pack, size // out_pack)
    if spec.kind == "row" and in_dim is not None:
        start, size = spec.in_range
        if start % in_pack or size % in_pack:
            raise ValueError(f"this rank's {size} input features at {start} are not a multiple of the "
                             f"packing ({in_pack})")
        return narrow(loaded, in_dim, start // in_pack, size // in_pack)
    return as_tensor(loaded)


def split(n: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, size) of this rank's equal part of ``n``."""
    if n % tp.world_size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({tp.world_size})")
    size = n // tp.world_size
    return tp.rank * size, size


def kv_head_range(num_kv_heads: int, tp: TPGroup | None) -> tuple[int, int]:
    """(first KV head, count) this rank holds; replicated when there are fewer KV heads than ranks."""
    if tp is None:
        return 0, num_kv_heads
    if num_kv_heads >= tp.world_size:
        return split(num_kv_heads, tp, "num_key_value_heads")
    if tp.world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp.world_size}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) to replicate KV heads")
    return tp.rank * num_kv_heads // tp.world_size, 1


def expert_range(num_experts: int, tp: TPGroup | None) -> tuple[int, int]:
    """(first expert, count) of the routed experts this rank holds whole under expert parallelism.

    vLLM's linear placement: contiguous blocks in rank order, ``E // tp`` experts each and one more
    on each of the first ``E % tp`` ranks (E = 10 over 4 ranks: 3, 3, 2, 2). Without TP: all of them.
    """
    if tp is None:
        return 0, num_experts
    base, extra = divmod(num_experts, tp.world_size)
    return tp.rank * base + min(tp.rank, extra), base + int(tp.rank < extra)


def local_heads(info: ModelInfo, tp: TPGroup | None) -> tuple[int, int]:
    """(q heads, KV heads) on this rank."""
    if tp is None:
        return info.num_heads, info.num_kv_heads
    return split(info.num_heads, tp, "num_attention_heads")[1], kv_head_range(info.num_kv_heads, tp)[1]


def check_tp_compatible(info: ModelInfo, tp_size: int, expert_parallel: bool = False) -> None:
    """Raises ValueError (before any process starts) when the model cannot be split ``tp_size`` ways
    (``expert_parallel``: routed experts whole per rank; a no-op on a model without experts)."""
    if info.num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({info.num_heads}) is not divisible by tensor_parallel_size "
                         f"({tp_size})")
    sizes = {"intermediate_size": info.intermediate_size, "moe_intermediate_size": info.moe_intermediate_size}
    if expert_parallel and info.is_moe:  # only the dense MLPs (dense layers, shared experts) split features
        if info.num_experts < tp_size:
            raise ValueError(f"num_experts ({info.num_experts}) is smaller than tensor_parallel_size ({tp_size}): "
                             "expert parallelism gives every rank at least one whole expert")
        sizes = {"shared experts' intermediate size": info.shared_expert_intermediate_size}
        if not all(info.moe_layers):
            sizes["intermediate_size"] = info.intermediate_size
    for what, size in sizes.items():
        if size % tp_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({tp_size})")
    kv = info.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ValueError(f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp_size}): one must divide "
                         "the other")


# -- the layers ---------------------------------------------------------------------------


class _ParallelLinear(FusedLinear):
    """A FusedLinear that holds one rank's slice (``tp_spec``); quantized methods must opt in."""

    tp_spec: TPSpec

    def set_linear_method(self, method: LinearMethod) -> None:
        if not getattr(method, "supports_tensor_parallel", False):
            raise ValueError(f"{type(method).__name__} does not support tensor parallelism yet: its weight "
                             "loaders must slice through shard_for_rank and then set supports_tensor_parallel")
        super().set_linear_method(method)


class ColumnParallelLinear(_ParallelLinear):
    """A FusedLinear holding rows ``out_ranges[i]`` of each shard ``i`` of the full weight."""

    def __init__(
        self,
        in_features: int,
        out_ranges: Sequence[tuple[int, int]],
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        shard_ids: Sequence[ShardId] = (),
    ) -> None:
        super().__init__(in_features, [size for _, size in out_ranges], bias, dtype, shard_ids)
        self.tp = tp
        keys = list(shard_ids) or [None]
        self.tp_spec = TPSpec("column", out_ranges=dict(zip(keys, out_ranges, strict=True)))

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: ShardId | None = None) -> None:
        if shard_id is not None and shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {self.shard_ids})")
        if shard_id is None and self.shard_ids:
            raise ValueError(f"fused parameter needs a shard id (one of {self.shard_ids})")
        super().weight_loader(param, shard_for_rank(self, loaded_weight, shard_id, out_dim=0), shard_id)


class RowParallelLinear(_ParallelLinear):
    """A FusedLinear holding input columns ``in_range``; the partial outputs are all-reduced,
    then the (whole, replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp: TPGroup) -> None:
        start, size = split(in_features, tp, "input features")
        super().__init__(size, (out_features,), bias, dtype)
        self.tp = tp
        self.tp_spec = TPSpec("row", in_range=(start, size))

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: ShardId | None = None) -> None:
        if param is self.bias:
            loaded_weight = as_tensor(loaded_weight)
        else:
            loaded_weight = shard_for_rank(self, loaded_weight, shard_id, in_dim=1)
        super().weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_method is not None:
            y = self.linear_method.apply(self, x, None)
        else:
            y = F.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _vocab_range(vocab: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, rows held incl. padding, valid rows) of this rank's vocabulary slice."""
    per_rank = -(-vocab // tp.world_size)
    start = tp.rank * per_rank
    return start, per_rank, max(0, min(vocab, start + per_rank) - start)


def _load_vocab_rows(layer: nn.Module, param: nn.Parameter, loaded_weight) -> None:
    """Copies this rank's valid vocabulary rows; padding rows are zero."""
    start, valid = layer.tp_spec.out_ranges[None]
    rows = narrow(loaded_weight, 0, start, valid)
    if tuple(rows.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"shape mismatch: checkpoint rows are {tuple(rows.shape[1:])}, parameter expects "
                         f"{tuple(param.shape[1:])}")
    param.data[:valid].copy_(rows)
    param.data[valid:].zero_()


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, start + rows)``; tokens of other ranks embed to 0, then all-reduce."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        start, rows, valid = _vocab_range(num_embeddings, tp)
        self.start, self.num_valid = start, valid
        self.tp_spec = TPSpec("vocab", out_ranges={None: (start, valid)})
        self.weight = new_param((rows, dim), dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter has no shards, got shard {shard_id!r}")
        _load_vocab_rows(self, param, loaded_weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(_ParallelLinear):
    """LM head over this rank's vocabulary rows; logits are gathered to rank 0.

    Rank 0 gets ``[N, vocab]``; the other ranks get an empty ``[N, 0]`` (they never sample)."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype, tp: TPGroup) -> None:
        start, rows, valid = _vocab_range(vocab, tp)
        super().__init__(hidden, (rows,), False, dtype)
        self.tp = tp
        self.vocab = vocab
        self.tp_spec = TPSpec("vocab", out_ranges={None: (start, valid)})

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter has no shards, got shard {shard_id!r}")
        _load_vocab_rows(self, param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.tp.gather_to_first(super().forward(x), dim=-1)
        return x.new_empty((x.shape[0], 0)) if full is None else full[:, : self.vocab]


# -- factories the model calls (tp=None: the single-device layers) -----------------------------


def qkv_proj(info: ModelInfo, dtype: torch.dtype, tp: TPGroup | None) -> FusedLinear:
    d = info.head_dim
    q_size, kv_size = info.num_heads * d, info.num_kv_heads * d
    if tp is None:
        return FusedLinear(info.hidden_size, (q_size, kv_size, kv_size), info.attention_bias, dtype, ("q", "k", "v"))
    q_start, q_len = split(q_size, tp, "num_attention_heads * head_dim")
    kv_first, kv_count = kv_head_range(info.num_kv_heads, tp)
    kv = (kv_first * d, kv_count * d)
    return ColumnParallelLinear(info.hidden_size, [(q_start, q_len), kv, kv], info.attention_bias, dtype, tp,
                                ("q", "k", "v"))


def o_proj(info: ModelInfo, dtype: torch.dtype, tp: TPGroup | None) -> FusedLinear:
    q_size = info.num_heads * info.head_dim
    if tp is None:
        return FusedLinear(q_size, (info.hidden_size,), info.o_proj_bias, dtype)
    return RowParallelLinear(q_size, info.hidden_size, info.o_proj_bias, dtype, tp)


def gate_up_proj(info: ModelInfo, dtype: torch.dtype, tp: TPGroup | None,
                 intermediate_size: int | None = None) -> FusedLinear:
    """gate|up of a dense MLP of ``intermediate_size`` features (default: the model's)."""
    i = intermediate_size or info.intermediate_size
    if tp is None:
        return FusedLinear(info.hidden_size, (i, i), info.mlp_bias, dtype, (0, 1))
    part = split(i, tp, "intermediate_size")
    return ColumnParallelLinear(info.hidden_size, [part, part], info.mlp_bias, dtype, tp, (0, 1))


def down_proj(info: ModelInfo, dtype: torch.dtype, tp: TPGroup | None,
              intermediate_size: int | None = None) -> FusedLinear:
    i = intermediate_size or info.intermediate_size
    if tp is None:
        return FusedLinear(i, (info.hidden_size,), info.mlp_bias, dtype)
    return RowParallelLinear(i, info.hidden_size, info.mlp_bias, dtype, tp)


def embed_tokens(info: ModelInfo, dtype: torch.dtype, tp: TPGroup | None) -> nn.Module:
    if tp is None:
        return Embedding(info.vocab_size, info.hidden_size, dtype)
    return VocabParallelEmbedding(info.vocab_size, info.hidden_size, dtype, tp)


def lm_head(info: ModelInfo, dtype: torch.dtype, tp: TPGroup | None) -> FusedLinear:
    if tp is None:
        return FusedLinear(info.hidden_size, (info.vocab_size,), False, dtype)
    return ParallelLMHead(info.hidden_size, info.vocab_size, dtype, tp)
