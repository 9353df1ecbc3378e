"""Chained sha256 hashes of full KV blocks, the keys of the prefix cache (no torch here).

    hash_0 = sha256(ROOT_HASH || tokens of block 0 || extra keys (e.g. cache_salt))
    hash_i = sha256(hash_{i-1} || tokens of block i)

A block's hash therefore pins its whole prefix. Token ids are packed little-endian,
int32 when every id fits (the common case) else int64, behind a width tag and a count,
and extra keys are typed and length-prefixed, so that no two different inputs share an
encoding. Python's ``hash()`` is never used: it is salted per process and attackers
could choose colliding token ids for it.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
ExtraKey = str | bytes | int

# Stands in for the parent hash of a sequence's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"paged-backend/prefix-cache/v1").digest()

assert array("i").itemsize == 4, "array('i') must be int32 for the int32 encoding"
_SWAP = sys.byteorder != "little"


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Width tag + count + the ids as little-endian int32 (or int64 when one doesn't fit).

    ``array('i')`` packs (and range-checks) int32 ids about twice as fast as ``struct``.
    """
    n = len(token_ids)
    try:
        packed = array("i", token_ids)
    except OverflowError:
        return struct.pack(f"<BI{n}q", 8, n, *token_ids)
    if _SWAP:
        packed.byteswap()
    return struct.pack("<BI", 4, n) + packed.tobytes()


def _pack_extra_key(key: ExtraKey) -> bytes:
    """Type tag + length + payload, so e.g. the str "1" and the int 1 differ."""
    if isinstance(key, bool) or not isinstance(key, str | bytes | int):
        raise TypeError(f"unsupported extra hash key type: {type(key).__name__}")
    if isinstance(key, int):
        return b"i" + struct.pack("<q", key)
    payload = key.encode("utf-8") if isinstance(key, str) else key
    tag = b"s" if isinstance(key, str) else b"b"
    return tag + struct.pack("<I", len(payload)) + payload


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """sha256(parent_hash || packed token ids || packed extra keys); parent None = first block."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(_pack_tokens(token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        h.update(_pack_extra_key(key))
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``block_hashes`` (in place).

    Invariant: ``block_hashes[i]`` is the chained hash of ``token_ids[: (i + 1) * block_size]``;
    ``cache_salt`` enters the first block only (the chain carries it to every later block).
    ``max_blocks`` caps how many hashes the list may hold after the call.
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full):
        extra: tuple[ExtraKey, ...] = (cache_salt,) if (i == 0 and cache_salt is not None) else ()
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        block_hashes.append(parent)
