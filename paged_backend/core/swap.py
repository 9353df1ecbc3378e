"""The host KV tier: swap preemption's bookkeeping (no torch).

A ``SwapSpace`` owns a ``BlockPool`` of host blocks (``--swap-space`` GiB of host memory,
pinned on CUDA, in the device cache's per-layer layout) and the host block list of each
swapped-out request. Host block 0 is a null block too (never handed out), so the pool's
accounting is the device pool's: ``num_blocks - 1`` usable blocks, free == usable when
nothing is swapped.

    pairs = swap.swap_out(req_id, device_block_ids)   # (device, host): copy before the blocks are reused
    ...the request waits in the scheduler's swapped queue, holding no device block...
    pairs = swap.swap_in(req_id, new_device_block_ids)  # (host, device): copy before its forward
    swap.free(req_id)                                 # aborted or finished while swapped out

Copies are the runner's (``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``);
this module only decides which host block holds which device block's contents.

When preemption swaps (``preemption_mode``): ``"recompute"`` never; ``"swap"`` whenever the
host pool has room; the default (``None``) swaps when there is host space and the request
has computed at least ``SWAP_MIN_TOKENS`` tokens. Below that a recompute is one short prefill
that rides along in a step (often partly a prefix-cache hit), while a swap costs two copies of
every block and a host block each; above it the prefill's compute grows with the context
while the copies stay a memcpy of its bytes.
"""

from __future__ import annotations

from paged_backend.core.block_pool import BlockPool, KVCacheBlock

SWAP_MIN_TOKENS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SwapSpace:
    """Host blocks and which swapped-out request holds which of them."""

    def __init__(self, num_host_blocks: int, block_size: int, preemption_mode: str | None = None,
                 min_tokens: int = SWAP_MIN_TOKENS) -> None:
        if preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}")
        self.pool = BlockPool(num_host_blocks, enable_caching=False)
        self.block_size = block_size
        self.mode = preemption_mode
        self.min_tokens = min_tokens
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_swapped_out_blocks = 0  # counters, since start
        self.num_swapped_in_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_usable(self) -> int:
        return self.pool.num_total_usable

    def blocks_needed(self, num_computed_tokens: int) -> int:
        """Blocks holding computed tokens: what a swap out copies."""
        return _cdiv(num_computed_tokens, self.block_size)

    def should_swap(self, num_computed_tokens: int) -> bool:
        """Swap (not recompute) a request preempted with this many computed tokens?"""
        if self.mode == "recompute" or num_computed_tokens <= 0:
            return False
        if self.mode is None and num_computed_tokens < self.min_tokens:
            return False
        return self.blocks_needed(num_computed_tokens) <= self.pool.num_free_blocks

    def host_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._req_blocks

    def swap_out(self, request_id: str, device_block_ids: list[int]) -> list[tuple[int, int]]:
        """Host blocks for ``device_block_ids`` (the request's blocks holding computed tokens, in
        order); returns the (device, host) copies. ValueError when the host pool is short."""
        if request_id in self._req_blocks:
            raise ValueError(f"request {request_id} is already swapped out")
        host = self.pool.get_new_blocks(len(device_block_ids))
        self._req_blocks[request_id] = host
        self.num_swapped_out_blocks += len(host)
        return [(d, h.block_id) for d, h in zip(device_block_ids, host, strict=True)]

    def swap_in(self, request_id: str, device_block_ids: list[int]) -> list[tuple[int, int]]:
        """The (host, device) copies bringing the request's blocks back into ``device_block_ids``
        (its new leading blocks); its host blocks are free again (a later swap out reuses them
        only after these copies, in stream order)."""
        host = self._req_blocks.pop(request_id)
        if len(device_block_ids) < len(host):
            raise ValueError(f"request {request_id}: {len(host)} host blocks, {len(device_block_ids)} device blocks")
        pairs = [(h.block_id, d) for h, d in zip(host, device_block_ids, strict=False)]
        self.pool.free_blocks(reversed(host))
        self.num_swapped_in_blocks += len(host)
        return pairs

    def free(self, request_id: str) -> None:
        """Give back the host blocks of a request that ends while swapped out (no-op otherwise)."""
        host = self._req_blocks.pop(request_id, None)
        if host:
            self.pool.free_blocks(reversed(host))
