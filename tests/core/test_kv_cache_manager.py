"""KVCacheManager scenarios with exact block ids (in the spirit of vLLM's test_prefix_caching.py)."""

from __future__ import annotations

from paged_backend.core.block_hash import extend_block_hashes
from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request
from paged_backend.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=16, cache_salt=cache_salt)


def schedule(mgr: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: prefix lookup, allocate, mark computed."""
    hit, num_hit = mgr.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit
    new = mgr.allocate_slots(req, num_new_tokens, hit)
    if new is None:
        return None
    req.num_computed_tokens += num_hit + num_new_tokens
    return [b.block_id for b in new]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(mgr: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in mgr.block_pool.blocks if b.ref_cnt}


def hashes_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS, salt)
    return out


def snapshot(mgr: KVCacheManager, *reqs: Request) -> tuple:
    pool = mgr.block_pool
    return (
        free_ids(mgr),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached_blocks),
        {r.request_id: mgr.get_block_ids(r.request_id) for r in reqs},
        list(mgr._pending_copies),
    )


def test_prefix_hit_then_lru_eviction_order() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)  # 10 usable
    a_tokens = list(range(56))  # 3.5 blocks
    a = make_request("a", a_tokens)
    assert schedule(mgr, a) == [1, 2, 3, 4]
    assert mgr.get_block_ids("a") == [1, 2, 3, 4]
    a_hashes = hashes_of(a_tokens)
    pool = mgr.block_pool
    assert [pool.get_cached_block(h).block_id for h in a_hashes] == [1, 2, 3]  # 3 full blocks cached
    assert pool.blocks[4].block_hash is None

    # same first 3 blocks, different tail: hit [1, 2, 3] + a fresh block
    b = make_request("b", a_tokens[:48] + [100 + i for i in range(8)])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [1, 2, 3] and num_hit == 48
    assert ref_counts(mgr) == {1: 1, 2: 1, 3: 1, 4: 1}  # lookup takes no reference
    assert [x.block_id for x in mgr.allocate_slots(b, 8, hit)] == [5]
    b.num_computed_tokens = 56
    assert mgr.get_block_ids("b") == [1, 2, 3, 5]
    assert ref_counts(mgr) == {1: 2, 2: 2, 3: 2, 4: 1, 5: 1}
    assert free_ids(mgr) == [6, 7, 8, 9, 10]
    assert mgr.stats.queries == 56 + 56 and mgr.stats.hits == 48 and mgr.stats.requests == 2

    # free both: each request's blocks go in reverse order, at ref count 0
    mgr.free(a)
    assert free_ids(mgr) == [6, 7, 8, 9, 10, 4]
    mgr.free(b)
    assert free_ids(mgr) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert mgr.num_free_blocks == 10 and mgr.usage == 0.0
    assert pool.get_cached_block(a_hashes[2]).block_id == 3  # still cached while free

    # new unrelated requests evict in LRU order; reused blocks lose their hash
    c = make_request("c", [999] * (7 * BS))
    assert schedule(mgr, c) == [6, 7, 8, 9, 10, 4, 5]
    d = make_request("d", [998] * 3)
    assert schedule(mgr, d) == [3]
    assert pool.blocks[3].block_hash is None
    assert pool.get_cached_block(a_hashes[2]) is None
    assert [pool.get_cached_block(h).block_id for h in a_hashes[:2]] == [1, 2]

    # the surviving prefix still hits
    e = make_request("e", a_tokens[:40])
    hit, num_hit = mgr.get_computed_blocks(e)
    assert [x.block_id for x in hit] == [1, 2] and num_hit == 32
    assert free_ids(mgr) == [2, 1]
    for r in (c, d):
        mgr.free(r)
    assert mgr.num_free_blocks == 10


def test_whole_prompt_in_full_blocks_hits_one_block_less() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    tokens = list(range(3 * BS))
    a = make_request("a", tokens)
    assert schedule(mgr, a) == [1, 2, 3]
    b = make_request("b", tokens)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [1, 2] and num_hit == 32
    # the last block is recomputed into a fresh block (the cached one keeps its entry)
    assert mgr.allocate_slots(b, BS, hit) is not None
    assert mgr.get_block_ids("b") == [1, 2, 4]
    assert mgr.block_pool.get_cached_block(hashes_of(tokens)[2]).block_id == 3
    assert mgr.block_pool.blocks[4].block_hash is None

    one_block = make_request("c", list(range(BS)))
    assert mgr.get_computed_blocks(one_block) == ([], 0)


def test_cache_salt_changes_the_hash() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    tokens = list(range(40))
    assert schedule(mgr, make_request("a", tokens, cache_salt="tenant-1")) == [1, 2, 3]
    assert hashes_of(tokens, "tenant-1") != hashes_of(tokens, "tenant-2")
    assert mgr.get_computed_blocks(make_request("b", tokens, cache_salt="tenant-2")) == ([], 0)
    assert mgr.get_computed_blocks(make_request("c", tokens)) == ([], 0)
    hit, n = mgr.get_computed_blocks(make_request("d", tokens, cache_salt="tenant-1"))
    assert [x.block_id for x in hit] == [1, 2] and n == 32


def test_hit_on_free_block_removes_it_from_free_queue() -> None:
    mgr = KVCacheManager(num_blocks=7, block_size=BS)
    tokens = list(range(40))
    a = make_request("a", tokens)
    assert schedule(mgr, a) == [1, 2, 3]
    mgr.free(a)
    assert free_ids(mgr) == [4, 5, 6, 3, 2, 1]
    b = make_request("b", tokens[:32] + [7, 7, 7])
    assert schedule(mgr, b) == [4]
    assert mgr.get_block_ids("b") == [1, 2, 4]
    assert free_ids(mgr) == [5, 6, 3]
    assert ref_counts(mgr) == {1: 1, 2: 1, 4: 1}
    mgr.free(b)
    assert free_ids(mgr) == [5, 6, 3, 4, 2, 1]


def test_chunked_prefill_and_decode_cache_blocks_as_they_fill() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    pool = mgr.block_pool
    tokens = list(range(40))
    a = make_request("a", tokens)
    assert schedule(mgr, a, 20) == [1, 2]
    h = hashes_of(tokens)
    assert pool.get_cached_block(h[0]).block_id == 1
    assert pool.get_cached_block(h[1]) is None  # only 4 of its 16 tokens scheduled
    assert mgr.allocate_slots(a, 20) is not None and mgr.get_block_ids("a") == [1, 2, 3]
    a.num_computed_tokens = 40
    assert pool.get_cached_block(h[1]).block_id == 2
    # decode: 8 more tokens fill block 3
    for t in range(8):
        a.append_output_token(500 + t)
        new = mgr.allocate_slots(a, 1)
        assert new == []
        a.num_computed_tokens += 1
    assert pool.get_cached_block(hashes_of(a.all_token_ids)[2]).block_id == 3
    a.append_output_token(600)
    assert [x.block_id for x in mgr.allocate_slots(a, 1)] == [4]
    assert mgr.allocated_slots() == 4 * BS
    mgr.free(a)
    assert mgr.allocated_slots() == 0


def test_fork_then_child_append_copies_on_write() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    tokens = list(range(20))
    parent = make_request("p", tokens)
    assert schedule(mgr, parent) == [1, 2]
    child = make_request("c", tokens)
    child.num_computed_tokens = parent.num_computed_tokens
    mgr.fork(parent, child)
    assert mgr.get_block_ids("c") == [1, 2]
    assert child.block_hashes == parent.block_hashes == hashes_of(tokens)
    assert ref_counts(mgr) == {1: 2, 2: 2}

    child.append_output_token(77)
    assert mgr.allocate_slots(child, 1) == []  # nothing appended at the end...
    child.num_computed_tokens += 1
    assert mgr.get_block_ids("c") == [1, 3]  # ...but the shared partial block was replaced
    assert mgr.get_block_ids("p") == [1, 2]
    assert mgr.take_pending_copies() == [(2, 3)]
    assert mgr.take_pending_copies() == []
    assert ref_counts(mgr) == {1: 2, 2: 1, 3: 1}

    # the parent now owns block 2 alone: its append writes in place, no copy
    parent.append_output_token(88)
    assert mgr.allocate_slots(parent, 1) == []
    assert mgr.get_block_ids("p") == [1, 2]
    assert mgr.take_pending_copies() == []

    mgr.free(parent)
    mgr.free(child)
    assert ref_counts(mgr) == {}
    assert mgr.num_free_blocks == 10


def test_fork_then_parent_writes_first_copies_once() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    parent = make_request("p", list(range(20)))
    schedule(mgr, parent)
    child = make_request("c", list(range(20)))
    mgr.fork(parent, child)
    parent.append_output_token(5)
    assert mgr.allocate_slots(parent, 1) == []
    assert mgr.get_block_ids("p") == [1, 3]
    assert mgr.take_pending_copies() == [(2, 3)]
    child.num_computed_tokens = 20
    child.append_output_token(6)
    assert mgr.allocate_slots(child, 1) == []
    assert mgr.get_block_ids("c") == [1, 2]
    assert mgr.take_pending_copies() == []


def test_allocate_returns_none_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", list(range(49)))
    assert schedule(mgr, a) == [1, 2, 3, 4]
    b = make_request("b", [3] * 20)
    before = snapshot(mgr, a, b)
    assert mgr.allocate_slots(b, 20) is None
    assert snapshot(mgr, a, b) == before
    assert mgr.num_blocks_of("b") == 0

    # a hit on free blocks leaves fewer blocks to allocate: 4 free, 3 of them are the hit
    mgr.free(a)
    assert free_ids(mgr) == [4, 3, 2, 1]
    c = make_request("c", list(range(48)) + [9] * 40)  # 6 blocks: 3 hit + 3 fresh
    hit, num_hit = mgr.get_computed_blocks(c)
    assert [x.block_id for x in hit] == [1, 2, 3] and num_hit == 48
    before = snapshot(mgr, a, c)
    assert mgr.allocate_slots(c, 40, hit) is None
    assert snapshot(mgr, a, c) == before
    assert mgr.allocate_slots(c, 16, hit) is not None  # 1 fresh block does fit
    assert mgr.get_block_ids("c") == [1, 2, 3, 4]
    mgr.free(c)


def test_free_drops_pending_copies_into_the_freed_blocks() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    parent = make_request("p", list(range(20)))
    schedule(mgr, parent)
    child = make_request("c", list(range(20)))
    child.num_computed_tokens = 20
    mgr.fork(parent, child)
    child.append_output_token(1)
    assert mgr.allocate_slots(child, 1) == []
    mgr.free(child)  # e.g. aborted before the step ran
    assert mgr.take_pending_copies() == []
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 10, 3]
    assert mgr.get_block_ids("p") == [1, 2]


def test_copy_on_write_that_does_not_fit_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)  # 2 usable
    parent = make_request("p", list(range(20)))
    assert schedule(mgr, parent) == [1, 2]
    child = make_request("c", list(range(20)))
    child.num_computed_tokens = 20
    mgr.fork(parent, child)
    child.append_output_token(1)
    before = snapshot(mgr, parent, child)
    assert mgr.allocate_slots(child, 1) is None
    assert snapshot(mgr, parent, child) == before
    mgr.free(child)
    mgr.free(parent)
    assert free_ids(mgr) == [2, 1]


def test_caching_disabled_manager() -> None:
    mgr = KVCacheManager(num_blocks=11, block_size=BS, enable_caching=False)
    tokens = list(range(40))
    assert schedule(mgr, make_request("a", tokens)) == [1, 2, 3]
    assert mgr.get_computed_blocks(make_request("b", tokens)) == ([], 0)
    assert mgr.block_pool.cached_blocks == {}
    assert mgr.stats.queries == 0


def test_capacity_helpers() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    assert mgr.can_fit(4 * BS)
    assert not mgr.can_fit(4 * BS + 1)
    a = make_request("a", list(range(17)))
    schedule(mgr, a)
    assert mgr.num_blocks_of("a") == 2
    assert mgr.usage == 0.5
    assert mgr.allocated_slots() == 2 * BS
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("b", list(range(17)))) == ([], 0)
    assert mgr.get_block_ids("a") == []


def test_block_ids_are_a_snapshot_kept_in_step_with_the_blocks() -> None:
    """``get_block_ids`` reads an id list the manager maintains: a copy, right after every change."""
    mgr = KVCacheManager(num_blocks=11, block_size=BS)
    a = make_request("a", list(range(20)))
    assert schedule(mgr, a) == [1, 2]
    ids = mgr.get_block_ids("a")
    ids.append(99)  # the caller's copy
    for t in range(13):  # decode into block 2 (fast path), then one more block
        a.append_output_token(700 + t)
        mgr.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert ids == [1, 2, 99] and mgr.get_block_ids("a") == [1, 2, 3]
    child = make_request("c", a.all_token_ids)
    child.num_computed_tokens = a.num_computed_tokens
    mgr.fork(a, child)
    child.append_output_token(5)
    assert mgr.allocate_slots(child, 1) == []  # copy-on-write of the shared partial block 3
    assert mgr.get_block_ids("c") == [1, 2, 4] and mgr.get_block_ids("a") == [1, 2, 3]
    for req in (a, child):
        mgr.free(req)
        assert mgr.get_block_ids(req.request_id) == [] and mgr.num_blocks_of(req.request_id) == 0
