"""The host KV tier's memory and its copies to and from the device cache.

Layout: one host tensor ``[num_host_blocks, block_bytes]`` (pinned on CUDA) where a host block holds
every layer's bytes of one block id, contiguous, layer after layer in ``kv_specs`` order; within a
layer, a per-head cache's K part then its V part (``[2, block_size, heads, head_dim]``), a latent
cache's ``[block_size, latent_dim]``. ``caches`` gives each layer a view in its spec's own shape
(``KVCacheSpec.shape(num_host_blocks)``, strided), so host block ``h`` of layer ``l`` reads as the
device cache's block does.

Copies go through a device staging buffer of whole host blocks (``staging_bytes``, default 256 MiB,
at most a quarter of the device's free memory when the tier is made, at least one block), in chunks of
that many blocks, with the pairs sorted by host block id:

    swap out (device -> host)  per layer one gather (``index_select`` on the block dim) into the
                               staging rows, then one device-to-host copy per run of consecutive host ids
    swap in  (host -> device)  one host-to-device copy per run of consecutive host ids into the staging
                               rows, then per layer one scatter (``index_copy_``) into the device cache

so a swap costs 2 x layers small kernels and a few large copies per chunk, whatever the block ids.

On CUDA everything runs on the tier's own stream, after the work queued before the call; the caller's
stream then waits only for what a later kernel of its own may touch: the gathers of the swap out (the
blocks it frees get reused) and, when there is a swap in, its scatters (a forward reads those blocks).
The device-to-host copies of a swap out without a swap in overlap whatever the caller queues next.
Every use of the staging buffer and of the host memory is on the one stream, so a later gather waits
for the copies that read the staging rows before, and a host block written by a pending copy is read
(by a later swap in) only after it; the host never reads the tier itself (``synchronize`` first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_backend.attention.kv_cache_spec import KVCacheSpec, block_runs

DEFAULT_STAGING_BYTES = 256 << 20
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class _Layer:
    """Where one layer's bytes sit in a host block, in words of the tier's word type."""

    spec: KVCacheSpec
    offset: int  # words before this layer's part of a host block
    parts: int  # 2: K then V (per-head layout); 1: the latent
    part_words: int  # one part of one block

    @property
    def words(self) -> int:
        return self.parts * self.part_words

    def rows(self, table: torch.Tensor, n: int) -> torch.Tensor:
        """This layer's bytes of the first ``n`` rows of ``table`` ([rows, block words]) as [parts, n, part_words]."""
        return table[:n, self.offset:self.offset + self.words].view(n, self.parts, self.part_words).transpose(0, 1)

    def device_view(self, cache: torch.Tensor, word: torch.dtype) -> torch.Tensor:
        """The layer's device cache as [parts, num_blocks, part_words] (the same memory)."""
        num_blocks = cache.shape[self.spec.block_dim]
        return cache.view(torch.uint8).view(self.parts, num_blocks, -1).view(word)


def _word_size(part_bytes: Sequence[int]) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every part: the gathers move words, not bytes."""
    return next(w for w in _WORDS if all(b % w == 0 for b in part_bytes))


def host_runs(host_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(row, host id, n) for each run of consecutive ``host_ids``: rows row .. row + n - 1 hold host
    blocks host id .. host id + n - 1 (``block_runs`` over (row, host id) pairs: the rows are consecutive)."""
    return block_runs(list(enumerate(host_ids)))


def staging_blocks(block_bytes: int, num_host_blocks: int, device: torch.device,
                   staging_bytes: int = DEFAULT_STAGING_BYTES) -> int:
    """Rows of the staging buffer: ``staging_bytes`` of whole host blocks, on CUDA at most a quarter of
    the device's free memory now, never more than the tier's blocks nor fewer than one."""
    limit = staging_bytes
    if device.type == "cuda":
        limit = min(limit, torch.cuda.mem_get_info(device)[0] // 4)
    return max(1, min(num_host_blocks, limit // block_bytes))


class HostKVTier:
    """``num_host_blocks`` host blocks of every layer in ``specs`` (host block 0 included, never used as a
    copy's source or destination by the scheduler), and the batched copies to and from ``device``."""

    def __init__(self, specs: Sequence[KVCacheSpec], num_host_blocks: int, device: torch.device | str,
                 pin_memory: bool = False, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.device = torch.device(device)
        part_bytes = [s.bytes_per_block // (1 if s.is_latent else 2) for s in specs]
        word_size = _word_size(part_bytes)
        self.word = _WORDS[word_size]
        self.layers: list[_Layer] = []
        offset = 0
        for spec, pb in zip(specs, part_bytes, strict=True):
            layer = _Layer(spec, offset, 1 if spec.is_latent else 2, pb // word_size)
            self.layers.append(layer)
            offset += layer.words
        self.block_bytes = offset * word_size
        self.num_blocks = num_host_blocks
        self.buffer = torch.zeros((num_host_blocks, offset), dtype=self.word, pin_memory=pin_memory)
        rows = staging_blocks(self.block_bytes, num_host_blocks, self.device, staging_bytes)
        self.staging = torch.empty((rows, offset), dtype=self.word, device=self.device)
        cuda = self.device.type == "cuda"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device) if cuda else None
        self._ready = torch.cuda.Event() if cuda else None  # what the caller's stream waits for

    @property
    def caches(self) -> list[torch.Tensor]:
        """Each layer's host blocks in its spec's shape (views of ``buffer``)."""
        out = []
        raw = self.buffer.view(torch.uint8)
        word_size = self.buffer.element_size()
        for layer in self.layers:
            spec = layer.spec
            lo = layer.offset * word_size
            flat = raw[:, lo:lo + layer.words * word_size].view(spec.dtype)
            if spec.is_latent:
                out.append(flat.view(self.num_blocks, spec.block_size, spec.latent_dim))
            else:
                out.append(flat.view(self.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
                           .transpose(0, 1))
        return out

    def swap(self, device_caches: Sequence[torch.Tensor], swap_out: Sequence[tuple[int, int]],
             swap_in: Sequence[tuple[int, int]]) -> None:
        """Device -> host ``(device, host)`` pairs, then host -> device ``(host, device)`` pairs, every layer.

        Within each list no host block and no device block is written twice; the swap out runs first (a
        block it writes back may be a swap in's source, a device block it reads a swap in's destination).
        On CUDA the caller's current stream waits for the gathers and the swap in before its next work."""
        if not swap_out and not swap_in:
            return
        stream = self.stream
        if stream is None:
            self._swap_out(device_caches, swap_out)
            self._swap_in(device_caches, swap_in)
            return
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the blocks swapped out hold KV of work queued before
        with torch.cuda.stream(stream):
            self._swap_out(device_caches, swap_out)  # records _ready after its last gather
            if swap_in:
                self._swap_in(device_caches, swap_in)
                self._ready.record(stream)
        current.wait_event(self._ready)

    def synchronize(self) -> None:
        """Wait for every copy queued so far (before the host reads ``buffer``)."""
        if self.stream is not None:
            self.stream.synchronize()

    def chunks(self, pairs: Sequence[tuple[int, int]], host_at: int) -> list[list[tuple[int, int]]]:
        """``pairs`` sorted by their host id (item ``host_at``), in chunks of at most the staging rows."""
        ordered = sorted(pairs, key=lambda p: p[host_at])
        rows = self.staging.shape[0]
        return [ordered[i:i + rows] for i in range(0, len(ordered), rows)]

    def _index(self, ids: list[int]) -> torch.Tensor:
        idx = torch.tensor(ids, dtype=torch.long)
        if self.device.type == "cuda":
            return idx.pin_memory().to(self.device, non_blocking=True)
        return idx.to(self.device)

    def _swap_out(self, device_caches: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        chunks = self.chunks(pairs, 1)
        for k, chunk in enumerate(chunks):
            n = len(chunk)
            idx = self._index([d for d, _ in chunk])
            for layer, cache in zip(self.layers, device_caches, strict=True):
                torch.index_select(layer.device_view(cache, self.word), 1, idx, out=layer.rows(self.staging, n))
            if k == len(chunks) - 1 and self._ready is not None:
                self._ready.record()  # the freed device blocks may be reused from here on
            for row, h, m in host_runs([h for _, h in chunk]):
                self.buffer[h:h + m].copy_(self.staging[row:row + m], non_blocking=True)

    def _swap_in(self, device_caches: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        for chunk in self.chunks(pairs, 0):
            n = len(chunk)
            for row, h, m in host_runs([h for h, _ in chunk]):
                self.staging[row:row + m].copy_(self.buffer[h:h + m], non_blocking=True)
            idx = self._index([d for _, d in chunk])
            for layer, cache in zip(self.layers, device_caches, strict=True):
                layer.device_view(cache, self.word).index_copy_(1, idx, layer.rows(self.staging, n))
