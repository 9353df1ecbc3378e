"""BlockPool, FreeBlockQueue and block hashing: exact block ids, LRU order, hash format."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from paged_backend.core.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from paged_backend.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


# ---- torch-free --------------------------------------------------------------------------


def test_core_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import paged_backend.core.block_hash, paged_backend.core.block_pool, paged_backend.core.kv_cache_manager\n"
        "import paged_backend.core.request, paged_backend.core.scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# ---- FreeBlockQueue ----------------------------------------------------------------------


def test_free_queue_popleft_append_remove_keep_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks[1:])
    assert ids(q.get_all_free_blocks()) == [1, 2, 3, 4, 5]
    assert q.popleft().block_id == 1
    q.remove(blocks[3])  # from the middle
    q.remove(blocks[5])  # the tail
    assert ids(q.get_all_free_blocks()) == [2, 4]
    q.append(blocks[1])
    q.append(blocks[5])
    assert ids(q.get_all_free_blocks()) == [2, 4, 1, 5]
    assert q.num_free_blocks == 4
    assert [q.popleft().block_id for _ in range(4)] == [2, 4, 1, 5]
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()


def test_free_queue_rejects_double_append_and_remove_of_absent() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks[1:])
    with pytest.raises(ValueError):
        q.append(blocks[1])
    q.remove(blocks[2])
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1]


# ---- BlockPool ---------------------------------------------------------------------------


def test_pool_initial_state_excludes_null_block() -> None:
    pool = BlockPool(8, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.num_total_usable == 7
    assert pool.num_free_blocks == 7
    assert pool.usage == 0.0
    assert pool.null_block.block_id == 0
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_get_new_blocks_pops_lru_and_sets_ref_count() -> None:
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert free_ids(pool) == [4, 5]
    assert pool.usage == pytest.approx(3 / 5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [4, 5]  # a failed request takes nothing
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.get_new_blocks(0) == []


def test_null_block_is_never_handed_out_freed_or_cached() -> None:
    pool = BlockPool(3, enable_caching=True)
    assert 0 not in ids(pool.get_new_blocks(2))
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    pool.cache_full_block(pool.null_block, b"h" * 32)
    assert pool.null_block.ref_cnt == 0
    assert pool.null_block.block_hash is None
    assert pool.cached_blocks == {}
    assert pool.num_free_blocks == 0


def test_free_appends_at_zero_ref_and_keeps_hash_until_reuse() -> None:
    pool = BlockPool(5, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.cache_full_block(b1, b"A" * 32)
    pool.cache_full_block(b2, b"B" * 32)
    pool.touch([b1])  # a second holder
    pool.free_blocks([b2, b1])
    assert b1.ref_cnt == 1 and b2.ref_cnt == 0
    assert free_ids(pool) == [4, 2]
    assert pool.get_cached_block(b"B" * 32) is b2  # free but still cached
    pool.free_blocks([b3, b1])
    assert free_ids(pool) == [4, 2, 3, 1]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b1])

    # reuse evicts in LRU order; only the reused block loses its hash
    assert ids(pool.get_new_blocks(2)) == [4, 2]
    assert b2.block_hash is None
    assert pool.get_cached_block(b"B" * 32) is None
    assert pool.get_cached_block(b"A" * 32) is b1
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    assert pool.cached_blocks == {}


def test_touch_on_free_cached_block_removes_it_from_free_queue() -> None:
    pool = BlockPool(5, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_block(b1, b"A" * 32)
    pool.free_blocks([b2, b1])
    assert free_ids(pool) == [3, 4, 2, 1]
    hit = pool.get_cached_block(b"A" * 32)
    assert hit is b1
    pool.touch([hit])
    assert b1.ref_cnt == 1
    assert free_ids(pool) == [3, 4, 2]
    pool.touch([b1])
    assert b1.ref_cnt == 2
    assert pool.num_free_blocks == 3


def test_cache_full_block_duplicate_hash_keeps_existing_entry() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, b"X" * 32)
    pool.cache_full_block(second, b"X" * 32)
    assert pool.get_cached_block(b"X" * 32) is first
    assert second.block_hash is None
    pool.cache_full_block(first, b"X" * 32)  # idempotent
    with pytest.raises(ValueError):
        pool.cache_full_block(first, b"Y" * 32)
    pool.free_blocks([second, first])
    # the uncached duplicate is reused without touching the map
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(b"X" * 32) is first


def test_caching_disabled_never_caches() -> None:
    pool = BlockPool(4, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, b"X" * 32)
    assert b.block_hash is None
    assert pool.get_cached_block(b"X" * 32) is None


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, b"X" * 32)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"X" * 32) is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"X" * 32) is None
    assert b.block_hash is None
    assert pool.num_free_blocks == 3


# ---- block hashing -----------------------------------------------------------------------


def test_hash_matches_documented_format() -> None:
    tokens = [1, 2, 70000]
    expected = hashlib.sha256(
        ROOT_HASH
        + struct.pack("<BI3i", 4, 3, *tokens)
        + struct.pack("<I", 1)
        + b"s"
        + struct.pack("<I", 4)
        + b"salt"
    ).digest()
    assert hash_block_tokens(None, tokens, ("salt",)) == expected
    big = [1, 2**40]
    expected_big = hashlib.sha256(
        b"P" * 32 + struct.pack("<BI2q", 8, 2, *big) + struct.pack("<I", 0)
    ).digest()
    assert hash_block_tokens(b"P" * 32, big) == expected_big


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(base) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4]) == base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("s",)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("1",)) != hash_block_tokens(None, [1, 2, 3, 4], (1,))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))  # type: ignore[arg-type]


def test_hash_is_stable_across_processes() -> None:
    """Not Python hash(): a fresh interpreter with another hash seed gives the same digest."""
    code = (
        "from paged_backend.core.block_hash import hash_block_tokens as h; print(h(None, [5, 6, 7], ('x',)).hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == hash_block_tokens(None, [5, 6, 7], ("x",)).hex()


def test_extend_block_hashes_chains_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4, cache_salt="s")
    h0 = hash_block_tokens(None, [0, 1, 2, 3], ("s",))
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert hashes == [h0, h1]  # the partial block [8, 9] is not hashed
    extend_block_hashes(hashes, tokens + [10, 11], 4, cache_salt="s")
    assert hashes == [h0, h1, hash_block_tokens(h1, [8, 9, 10, 11])]
    capped: list[bytes] = []
    extend_block_hashes(capped, tokens, 4, cache_salt="s", max_blocks=1)
    assert capped == [h0]
