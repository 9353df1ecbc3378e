"""Per-request KV block lists on top of the BlockPool: prefix hits, slot allocation, COW, fork.

No torch here. The scheduler drives it:

    blocks, n = mgr.get_computed_blocks(req)          # waiting request: longest cached prefix
    more = mgr.get_host_computed_blocks(req, len(blocks))  # its continuation, block by block in either tier
    new = mgr.allocate_slots(req, num_new, blocks, more)   # None -> nothing changed; preempt or wait
    copies = mgr.take_pending_copies()                 # model runner copies KV src -> dst first
    ...forward writes K/V of the scheduled tokens...
    mgr.trim(req)                                      # rejected draft tokens given up
    mgr.free(req)                                      # finished, aborted or preempted

With a host tier attached (``attach_host_tier``, core/swap.py) the prefix cache has two tiers:
a cached block the device pool evicts is written back to the host. A lookup walks the hash chain
block by block, taking each block from the device pool when it holds the hash and from the host
otherwise, and stops at the first block in neither; ``allocate_slots`` uses a device hit in place
(a reference, no copy) wherever it stands in the chain and gives a host hit a new device block
that the host copy fills (``SwapSpace.take_copies``) before the forward; the hash chain is the
same in both tiers.

A request's block list covers its token positions in order: token ``p`` lives in slot
``p % block_size`` of ``blocks[p // block_size]``.

Invariants:
  - every block's ref_cnt equals the number of live requests whose list holds it;
  - a block that a request writes into is held by that request alone (shared partial blocks
    are copied first: copy-on-write);
  - blocks are hashed (cached) at allocation for the tokens scheduled in that step, so the
    caller must run the forward for everything it allocated before it frees or preempts.

Per decode step the scheduler may skip ``allocate_slots`` (a Python call per running
request): when ``num_computed + num_new < quiet_end[request_id]`` the new tokens land in
the request's current block, which is private and does not fill up, so the call would
allocate, copy and cache nothing. Every allocation, fork, trim and free keeps ``quiet_end`` right.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_backend.core.block_hash import extend_block_hashes
from paged_backend.core.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from paged_backend.core.request import Request

if TYPE_CHECKING:
    from paged_backend.core.swap import SwapSpace


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps request ids to block lists and keeps the pool's ref counts and prefix cache right."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # the same lists as block ids, kept in step with _req_blocks. A list is never changed in
        # place once stored (a new list whenever the request's blocks change), so the scheduler
        # hands these lists out as snapshots (read-only for everyone else: use get_block_ids)
        self.req_block_ids: dict[str, list[int]] = {}
        # per request: a step whose tokens all land before this position needs no allocate_slots
        # call: they go into the request's current private block and do not fill it
        self.quiet_end: dict[str, int] = {}
        # how many leading blocks of each request have been offered to the prefix cache
        self._num_cached_blocks: dict[str, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.host: SwapSpace | None = None  # the prefix cache's host tier (attach_host_tier)

    def attach_host_tier(self, host: SwapSpace) -> None:
        """Make ``host`` the prefix cache's second tier (with prefix caching on both sides): the
        device pool's evictions are written back there and lookups continue there."""
        if self.enable_caching and host.pool.enable_caching:
            self.host = host
            self.block_pool.on_evict = host.write_back

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def stats(self) -> PrefixCacheStats:
        return self.block_pool.stats

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids (a snapshot: later steps change the request's list)."""
        ids = self.req_block_ids.get(request_id)
        return ids.copy() if ids is not None else []

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._req_blocks.get(request_id, ()))

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of ``num_tokens`` tokens fit the whole pool (all blocks free)?"""
        return _cdiv(num_tokens, self.block_size) <= self.block_pool.num_total_usable

    def allocated_slots(self) -> int:
        """KV slots in blocks that are in use (a shared block counts once), for the KV-waste metric."""
        return self.block_pool.num_used_blocks * self.block_size

    # ---- prefix cache --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, and its length in tokens.

        Never covers the last token (its logits must be computed), so a prompt of exactly N
        full blocks hits at most N-1. Extends ``request.block_hashes``; records a query in
        ``stats``; takes no references (``allocate_slots`` does). For requests holding no blocks.
        """
        if not self.enable_caching:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:self._max_hit_blocks(request)]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        num_hit_tokens = len(hit) * self.block_size
        self.block_pool.stats.record(request.num_tokens, num_hit_tokens)
        return hit, num_hit_tokens

    def get_host_computed_blocks(self, request: Request, num_device_hits: int) -> list[KVCacheBlock]:
        """The chain's continuation past a device run of ``num_device_hits`` blocks (after
        ``get_computed_blocks``), with a host tier: block by block, the device pool's block when it
        holds the hash, else the host tier's, stopping at the first block in neither (never covering
        the last token). A hash held by both tiers is taken from the device. The list mixes the two
        pools' blocks (``allocate_slots`` tells them apart by ``BlockPool.owns``). Counting: each
        block counts as a hit of the tier that serves it, so the device blocks found here are added
        to ``stats``' hits (its query was recorded by ``get_computed_blocks``) and the host tier's
        ``stats`` records a query of the prompt's tokens with its host blocks as hits. Takes no
        references (``allocate_slots`` does). [] without a tier."""
        host = self.host
        if host is None:
            return []
        on_device, on_host = self.block_pool.get_cached_block, host.pool.get_cached_block
        hit: list[KVCacheBlock] = []
        num_device = 0
        for block_hash in request.block_hashes[num_device_hits:self._max_hit_blocks(request)]:
            block = on_device(block_hash)
            if block is not None:
                num_device += 1
            else:
                block = on_host(block_hash)
                if block is None:
                    break
            hit.append(block)
        bs = self.block_size
        self.block_pool.stats.record_hits(num_device * bs)
        host.stats.record(request.num_tokens, (len(hit) - num_device) * bs)
        return hit

    def get_cached_run(self, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        """The device blocks cached under the request's first ``max_blocks`` hashes, in order, up to the
        first miss (a swapped-out request's blocks that no one reused since: they resume in place). No
        counting, no references (``allocate_slots`` takes them). [] without prefix caching."""
        if not self.enable_caching:
            return []
        run: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            run.append(block)
        return run

    def _max_hit_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        host_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_computed + num_new_tokens`` tokens, where num_computed is
        ``request.num_computed_tokens`` plus the prefix-hit blocks ``new_computed_blocks`` (the device
        run) and the chain's continuation after them, ``host_computed_blocks`` (from
        ``get_host_computed_blocks``): a device block there is used in place like the run's, a host
        block gets the next new device block, filled by a host copy queued in the tier.

        Takes references on the hit blocks, copies (COW) any shared block that the new tokens
        write into, appends fresh blocks, then caches every block those tokens fill.
        Returns the new device blocks in list order (those filled from the host, then those appended
        at the end; COW replacements show in ``get_block_ids`` and ``take_pending_copies``), or
        None -- changing nothing -- when the pool cannot provide them. Check the result with
        ``is None``: ``[]`` is success.
        """
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id)
        if blocks and not new_computed_blocks and not host_computed_blocks and num_new_tokens > 0:
            # fast path (a decode step, mostly): the held blocks have room and the ones written
            # are private, so nothing is allocated or copied; only a block just filled is cached
            bs = self.block_size
            num_computed = request.num_computed_tokens
            num_total = num_computed + num_new_tokens
            if num_total <= len(blocks) * bs:
                if num_new_tokens == 1:
                    private = blocks[num_computed // bs].ref_cnt == 1
                else:
                    private = True
                    for i in range(num_computed // bs, -(-num_total // bs)):
                        if blocks[i].ref_cnt > 1:
                            private = False
                            break
                if private:
                    # the earlier calls cached every block their (known) tokens filled, so
                    # only a block boundary crossed now can add a full block
                    if self.enable_caching and num_total // bs > num_computed // bs:
                        self._cache_full_blocks(request, blocks, min(num_total, len(request.all_token_ids)))
                    self.quiet_end[req_id] = num_total if num_total % bs == 0 else (num_total // bs + 1) * bs
                    return []
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        run = new_computed_blocks or []
        continued = host_computed_blocks or []
        if blocks is None:
            blocks = []
        if (run or continued) and blocks:
            raise ValueError(f"request {req_id} already holds blocks; prefix hits are for new requests")
        owns = self.block_pool.owns
        hit_blocks = run + [b for b in continued if owns(b)] if continued else run  # used in place
        host_hits = [b for b in continued if not owns(b)]

        num_computed = request.num_computed_tokens + (len(run) + len(continued)) * self.block_size
        num_total = num_computed + num_new_tokens
        num_held = len(blocks) + len(hit_blocks)
        num_fresh = max(0, _cdiv(num_total, self.block_size) - num_held)
        cow_indices = self._shared_written_blocks(blocks, num_computed, num_total)

        # hit blocks sitting in the free queue stop being allocatable once touched
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_fresh + len(cow_indices) > self.block_pool.num_free_blocks - num_free_hits:
            return None

        self.block_pool.touch(hit_blocks)  # before allocating, which then never evicts them
        if host_hits:  # held first: the allocations below may write evicted blocks back to the host
            self.host.hold(host_hits)
        self._req_blocks[req_id] = blocks
        self._num_cached_blocks.setdefault(req_id, len(run))
        for i in cow_indices:
            self._copy_on_write(blocks, i)
        fresh = self.block_pool.get_new_blocks(num_fresh)
        blocks.extend(run)
        if continued:  # the chain in order: a device block in place, a host hit into the next new block
            loaded = iter(fresh)
            blocks.extend(b if owns(b) else next(loaded) for b in continued)
            if host_hits:
                self.host.load(host_hits, [b.block_id for b in fresh[:len(host_hits)]])
            blocks.extend(loaded)
        else:
            blocks.extend(fresh)
        self.req_block_ids[req_id] = [b.block_id for b in blocks]
        self._cache_full_blocks(request, blocks, min(num_total, request.num_tokens))
        bs = self.block_size  # the written blocks are private now (copied on write)
        quiet = num_new_tokens > 0 and num_total % bs != 0
        self.quiet_end[req_id] = (num_total // bs + 1) * bs if quiet else num_total
        return fresh

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The prefix tier's (device, host) write-backs and (host, device) loads of this step's plan,
        for ``blocks_to_swap_out`` / ``blocks_to_swap_in``; ([], []) without a host tier."""
        return self.host.take_copies() if self.host is not None else ([], [])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, both tiers; only when every device block is free and no request
        is swapped out (returns True then)."""
        if self.host is not None and self.host.pool.num_free_blocks != self.host.pool.num_total_usable:
            return False
        return self.block_pool.reset_prefix_cache() and (self.host is None or self.host.reset_prefix_cache())

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src_block_id, dst_block_id) KV copies that must happen before this step's forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first (so they are evicted first), and forget it.

        Pending copies into its blocks are dropped (a COW destination is private to its request).
        """
        blocks = self._req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.quiet_end.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if self._pending_copies:
            own = {b.block_id for b in blocks}
            self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in own]
        self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request) -> None:
        """Free the blocks past ``request.num_computed_tokens`` (tail first), after a step computed
        positions it then gave up (rejected draft tokens). Those blocks hold no token the request
        keeps, so none of them was cached; the kept last block stays private."""
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id)
        if blocks is None:
            return
        bs = self.block_size
        num_computed = request.num_computed_tokens
        keep = _cdiv(num_computed, bs)
        if keep < len(blocks):
            dropped = blocks[keep:]
            del blocks[keep:]
            self.req_block_ids[req_id] = [b.block_id for b in blocks]
            self.block_pool.free_blocks(reversed(dropped))
        self.quiet_end[req_id] = (num_computed // bs + 1) * bs if num_computed % bs else num_computed

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share every block of ``parent`` (ref_cnt += 1 each) and its block hashes.

        The child's token ids must start with the parent's; later writes into a shared partial
        block are copied first (see ``allocate_slots``).
        """
        if self._req_blocks.get(child.request_id):
            raise ValueError(f"child {child.request_id} already holds blocks")
        blocks = self._req_blocks.get(parent.request_id, [])
        self.block_pool.touch(blocks)
        self._req_blocks[child.request_id] = list(blocks)
        self.req_block_ids[child.request_id] = [b.block_id for b in blocks]
        # the partial block is shared now: the next write of either must copy it first
        self.quiet_end[child.request_id] = self.quiet_end[parent.request_id] = 0
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    # ---- helpers -------------------------------------------------------------------------

    def _shared_written_blocks(self, blocks: list[KVCacheBlock], start: int, end: int) -> list[int]:
        """Indices of held blocks that slots [start, end) write into and that others also hold."""
        if end <= start:
            return []
        first = start // self.block_size
        last = min(len(blocks), _cdiv(end, self.block_size))
        return [i for i in range(first, last) if blocks[i].ref_cnt > 1]

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int) -> None:
        """Swap a private copy in for the shared ``blocks[index]`` and queue the KV copy."""
        shared = blocks[index]
        (private,) = self.block_pool.get_new_blocks(1)
        self._pending_copies.append((shared.block_id, private.block_id))
        blocks[index] = private
        self.block_pool.free_blocks([shared])

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_known: int) -> None:
        """Hash and cache the blocks that the first ``num_known`` tokens fill completely."""
        if not self.enable_caching:
            return
        num_full = min(num_known // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt, num_full
        )
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full
