"""The host KV tier: swap preemption and the prefix cache's second tier (no torch).

A ``SwapSpace`` owns a ``BlockPool`` of host blocks (``--swap-space`` GiB of host memory,
pinned on CUDA, a host block holding every layer's bytes of one block: worker/host_kv_tier.py)
and the host block list of each swapped-out request. Host block 0 is a null block too (never handed out), so the pool's
accounting is the device pool's: ``num_blocks - 1`` usable blocks, free == usable when
nothing is swapped.

Swap preemption:

    pairs = swap.swap_out(req_id, device_block_ids, hashes)  # (device, host): copy before the blocks are reused
    ...the request waits in the scheduler's swapped queue, holding no device block...
    pairs = swap.swap_in(req_id, new_device_block_ids)  # (host, device): copy before its forward
    swap.free(req_id)                                 # aborted or finished while swapped out

The prefix tier (``prefix_tier``, with prefix caching on; ``KVCacheManager.attach_host_tier``):
a full device block evicted from the device pool's free queue (its hash still valid) is written
back here (``write_back``: a host block cached under the same hash, LRU like the device pool, the
host's least recent cached block evicted when none is free), and a prefix lookup takes each block of
its chain that the device pool misses from here (``pool.get_cached_block``; the walk is
``KVCacheManager.get_host_computed_blocks``); a hit is copied back into a new device block
(``hold`` then ``load``) instead of being recomputed. A swapped-out request's full blocks are
cached under their hashes too, so they serve prefix hits and are not written back a second time.

Copies are the runner's (``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``, applied
swap out first, then swap in, copy-on-write and the forward); this module only decides which
host block holds which device block's contents. A host block that one of the step's copies reads
or writes (written back, hit, or just swapped in) is held until ``take_copies`` ends the step's
plan, so no two copies of one step touch the same host block in an order that matters.

When preemption swaps (``preemption_mode``): ``"recompute"`` never; ``"swap"`` whenever the
host pool has room; the default (``None``) swaps when there is host space and the request
has computed at least ``SWAP_MIN_TOKENS`` tokens. Below that a recompute is one short prefill
that rides along in a step (often partly a prefix-cache hit), while a swap costs two copies of
every block and a host block each; above it the prefill's compute grows with the context
while the copies stay a memcpy of its bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_backend.core.block_hash import BlockHash
from paged_backend.core.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats

SWAP_MIN_TOKENS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SwapSpace:
    """Host blocks: which swapped-out request holds which of them, and the prefix tier's cached ones."""

    def __init__(self, num_host_blocks: int, block_size: int, preemption_mode: str | None = None,
                 min_tokens: int = SWAP_MIN_TOKENS, prefix_tier: bool = True) -> None:
        if preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {preemption_mode!r}")
        self.pool = BlockPool(num_host_blocks, enable_caching=prefix_tier)
        self.block_size = block_size
        self.mode = preemption_mode
        self.min_tokens = min_tokens
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # host blocks this step's copies read or write: given back by take_copies, once the plan is made
        self._held: list[KVCacheBlock] = []
        self._pending_out: list[tuple[int, int]] = []  # write-backs (device, host)
        self._pending_in: list[tuple[int, int]] = []  # prefix hits (host, device)
        self.stats = PrefixCacheStats()  # the prefix tier's lookups: tokens queried, tokens hit here
        self.num_swapped_out_blocks = 0  # counters, since start
        self.num_swapped_in_blocks = 0
        self.num_reused_in_place_blocks = 0  # swapped-out blocks found still cached on the device at swap in
        self.num_written_back_blocks = 0  # device evictions copied here
        self.num_loaded_blocks = 0  # prefix hits copied back to the device

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_usable(self) -> int:
        return self.pool.num_total_usable

    @property
    def usage(self) -> float:
        """Fraction of usable host blocks in use (swapped-out requests, this step's copies)."""
        return self.pool.usage

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

    # ---- swap preemption -----------------------------------------------------------------

    def swap_out(self, request_id: str, device_block_ids: list[int],
                 block_hashes: Sequence[BlockHash] = ()) -> list[tuple[int, int]]:
        """Host blocks for ``device_block_ids`` (the request's blocks holding computed tokens, in
        order); returns the (device, host) copies. ``block_hashes``: the hashes of its leading full
        computed blocks, under which the host blocks are cached too (the prefix tier). ValueError
        when the host pool is short."""
        if request_id in self._req_blocks:
            raise ValueError(f"request {request_id} is already swapped out")
        host = self.pool.get_new_blocks(len(device_block_ids))
        for block, block_hash in zip(host, block_hashes, strict=False):
            self.pool.cache_full_block(block, block_hash)  # a hash already held here keeps its block
        self._req_blocks[request_id] = host
        self.num_swapped_out_blocks += len(host)
        return [(d, h.block_id) for d, h in zip(device_block_ids, host, strict=True)]

    def swap_in(self, request_id: str, device_block_ids: list[int], num_in_place: int = 0) -> list[tuple[int, int]]:
        """The (host, device) copies bringing the request's blocks back into ``device_block_ids``
        (its new leading blocks), but for the first ``num_in_place``: device blocks still cached under
        their hashes, used as they are; its host blocks are free again once the step's plan is made
        (``take_copies``), keeping their hashes."""
        host = self._req_blocks.pop(request_id)
        if len(device_block_ids) < len(host) or num_in_place > len(host):
            raise ValueError(f"request {request_id}: {len(host)} host blocks, {len(device_block_ids)} device blocks, "
                             f"{num_in_place} in place")
        pairs = [(h.block_id, d) for h, d in zip(host[num_in_place:], device_block_ids[num_in_place:], strict=False)]
        self._held.extend(reversed(host))  # the request's references, dropped by take_copies
        self.num_swapped_in_blocks += len(pairs)
        self.num_reused_in_place_blocks += num_in_place
        return pairs

    def free(self, request_id: str) -> None:
        """Give back the host blocks of a request that ends while swapped out (no-op otherwise)."""
        host = self._req_blocks.pop(request_id, None)
        if host:
            self.pool.free_blocks(reversed(host))

    # ---- the prefix tier -----------------------------------------------------------------

    def write_back(self, device_block_id: int, block_hash: BlockHash) -> None:
        """The device pool evicts ``device_block_id`` (cached under ``block_hash``): keep its content
        here, in a host block cached under the same hash (the host's least recent cached block is
        evicted for it), copied before anything of this step writes the device block. A hash already
        here is only marked recently used; with every host block in use the content is dropped."""
        pool = self.pool
        block = pool.get_cached_block(block_hash)
        if block is not None:
            pool.touch((block,))  # to the free queue's tail (or one more reference, dropped at once)
            pool.free_blocks((block,))
            return
        if not pool.enable_caching or pool.num_free_blocks == 0:
            return
        (block,) = pool.get_new_blocks(1)
        pool.cache_full_block(block, block_hash)
        self._held.append(block)
        self._pending_out.append((device_block_id, block.block_id))
        self.num_written_back_blocks += 1

    def hold(self, blocks: list[KVCacheBlock]) -> None:
        """Keep prefix-hit host blocks until this step's plan is made: before the device blocks for them
        are allocated, since those allocations write evicted blocks back here."""
        self.pool.touch(blocks)
        self._held.extend(blocks)

    def load(self, blocks: list[KVCacheBlock], device_block_ids: list[int]) -> None:
        """Queue the (host, device) copies of held prefix-hit ``blocks`` into new device blocks."""
        self._pending_in += [(h.block_id, d) for h, d in zip(blocks, device_block_ids, strict=True)]
        self.num_loaded_blocks += len(blocks)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """End of a step's plan: the prefix tier's (device, host) write-backs and (host, device) loads;
        the host blocks they and the step's swap-ins use are free again (cached blocks at the free
        queue's tail, most recent)."""
        out, self._pending_out = self._pending_out, []
        into, self._pending_in = self._pending_in, []
        if self._held:
            held, self._held = self._held, []
            self.pool.free_blocks(held)
        return out, into

    def reset_prefix_cache(self) -> bool:
        """Forget the cached host hashes; only when no request is swapped out (returns True then)."""
        return self.pool.reset_prefix_cache()
