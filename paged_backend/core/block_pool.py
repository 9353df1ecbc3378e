"""The KV block pool: ref-counted blocks, an O(1) LRU free queue and the prefix-cache map.

No torch here: blocks are bookkeeping only; the model runner owns the KV tensors.

Invariants (tests assert them after every step):
  - block 0 is the null block: never allocated, freed, cached or put in the free queue;
  - a usable block is either in use (ref_cnt > 0) or in the free queue (ref_cnt == 0);
  - a free block keeps its hash and stays in the hash -> block map until it is reused
    (``get_new_blocks`` evicts it then); ``block.block_hash is not None`` exactly when
    ``cached_blocks[block.block_hash] is block``;
  - the free queue is LRU: ``popleft`` returns the least recently freed block; at start
    it holds block ids 1..N-1 in order;
  - ``on_evict`` (the host tier's write-back, when set) sees every hash ``get_new_blocks`` evicts,
    with the block id, before the block is handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from paged_backend.core.block_hash import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` KV slots: its id, ref count and (if full and cached) hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "_prev_free", "_next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # neighbours in the FreeBlockQueue; both None while the block is not in it
        self._prev_free: KVCacheBlock | None = None
        self._next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: popleft/append/remove are O(1).

    The head is the least recently freed block (evicted first), the tail the most recent.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first block
        self._tail = KVCacheBlock(-2)  # sentinel after the last block
        self._head._next_free = self._tail
        self._tail._prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block; ValueError if the queue is empty."""
        first = self._head._next_free
        if first is self._tail or first is None:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (most recently freed)."""
        if block._prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail._prev_free
        assert last is not None
        last._next_free = block
        block._prev_free = last
        block._next_free = self._tail
        self._tail._prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue (a prefix hit on a free block)."""
        prev, nxt = block._prev_free, block._next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev._next_free = nxt
        nxt._prev_free = prev
        block._prev_free = block._next_free = None
        self.num_free_blocks -= 1

    @staticmethod
    def contains(block: KVCacheBlock) -> bool:
        return block._prev_free is not None

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (next evicted) to tail; O(n), for tests and debugging."""
        out: list[KVCacheBlock] = []
        node = self._head._next_free
        while node is not None and node is not self._tail:
            out.append(node)
            node = node._next_free
        return out


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters for metrics: tokens looked up and tokens found, since start."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from cached blocks

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens

    def record_hits(self, num_hit_tokens: int) -> None:
        """More hits for the lookup recorded last (blocks of its chain found past the first miss)."""
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Owns every KVCacheBlock: hands out free ones, ref-counts them and caches full ones by hash.

    ``num_blocks`` includes the null block 0, so ``num_blocks - 1`` blocks are usable.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.stats = PrefixCacheStats()
        # called with (block_id, block_hash) for each cached block get_new_blocks evicts
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_total_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_usable - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (ref_cnt > 0); cached free blocks count as free."""
        return self.num_used_blocks / self.num_total_usable

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` LRU free blocks with ref_cnt 1, evicting their old hashes; ValueError if short."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        out = []
        popleft = self.free_block_queue.popleft
        for _ in range(n):
            block = popleft()
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def owns(self, block: KVCacheBlock) -> bool:
        """Is ``block`` one of this pool's blocks (not another pool's block of the same id)?"""
        block_id = block.block_id
        return 0 <= block_id < self.num_blocks and self.blocks[block_id] is block

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the content of ``block_hash``, in use or free; None on a miss."""
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hit or fork); a free one leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, in the given order; at 0 it joins the free-queue tail.

        Callers pass a request's blocks tail first, so its tail blocks are evicted first.
        """
        append = self.free_block_queue.append
        for block in ordered_blocks:
            if block.block_id == 0:  # the null block
                continue
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt = ref_cnt - 1
            if ref_cnt == 1:
                append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a newly filled full block under ``block_hash``.

        If another block already holds that hash the existing entry wins and ``block`` stays
        uncached (it is freed without a hash). Re-caching a block under its own hash is a no-op.
        """
        if not self.enable_caching or block.is_null:
            return
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block} is already cached under a different hash")
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed (returns True) when every block is free."""
        if self.num_free_blocks != self.num_total_usable:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash]
        block.block_hash = None
