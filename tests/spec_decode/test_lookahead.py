"""The proposers' lookahead allocations and the scheduler under async scheduling with speculation, on exact
block ids (no torch, no model): a lookahead allocation never caches a block whose last slot the target has not
written, and a request whose verification is in flight waits, then rolls back only while it runs."""

from __future__ import annotations

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import Scheduler
from paged_backend.engine.draft_model import allocate_lookahead
from paged_backend.sampling_params import SamplingParams


def _setup(skip_in_flight: bool = False) -> tuple[KVCacheManager, Scheduler]:
    kv = KVCacheManager(11, 4, True)
    return kv, Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                         skip_in_flight=skip_in_flight)


def _decoding(sched: Scheduler, *prompts: list[int]) -> list[Request]:
    """Requests whose prompts are computed (one step) and whose first output token (500) is known."""
    reqs = [Request(str(i), p, SamplingParams(), max_tokens=20) for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add_request(req)
    sched.schedule()
    for req in reqs:
        req.append_output_token(500)
    return reqs


def _hit_blocks(kv: KVCacheManager, tokens: list[int]) -> int:
    return len(kv.get_computed_blocks(Request("probe", tokens, SamplingParams(), max_tokens=1))[0])


def test_a_lookahead_allocation_leaves_a_block_ended_by_the_last_known_token_uncached():
    kv, sched = _setup()
    (req,) = _decoding(sched, [0, 1, 2])  # 500 at position 3 ends block 0; its KV is not computed
    assert not allocate_lookahead(kv, req, 2)
    assert kv.get_block_ids("0") == [1] and _hit_blocks(kv, [0, 1, 2, 500, 9]) == 0
    # what it prevents: the plain allocation caches block 0 with slot 3 unwritten, a prefix hit for others
    assert kv.allocate_slots(req, 2) is not None
    assert _hit_blocks(kv, [0, 1, 2, 500, 9]) == 1


def test_a_lookahead_allocation_inside_or_past_a_block():
    kv, sched = _setup()
    (req,) = _decoding(sched, [0, 1])  # 500 at position 2: the block is not full
    assert allocate_lookahead(kv, req, 3)  # positions 2..4 cross into a second block
    assert kv.get_block_ids("0") == [1, 2] and _hit_blocks(kv, [0, 1, 500, 7, 9]) == 0


def test_a_verification_in_flight_waits_and_rolls_back_only_while_running():
    kv, sched = _setup(skip_in_flight=True)
    a, b = _decoding(sched, [0, 1, 2, 3, 4], [10, 11, 12, 13, 14])
    a.spec_token_ids, b.spec_token_ids = [7, 8], [17, 18]
    out = sched.schedule()
    assert [(s.request_id, s.num_draft) for s in out.scheduled] == [("0", 2), ("1", 2)]
    a.num_pending = b.num_pending = 1  # both verifications in flight (async scheduling)
    assert sched.schedule().is_empty  # how many drafts they keep is not known: neither is placed
    sched.finish(b, RequestStatus.FINISHED_ABORTED)  # aborted meanwhile
    a.num_pending = b.num_pending = 0
    sched.rollback_drafts(a, 1)  # a kept one draft: its computed tokens drop by the rejected one
    sched.rollback_drafts(b, 2)  # b has nothing left to roll back
    assert (a.num_computed_tokens, a.spec_token_ids, b.num_computed_tokens) == (7, [], 8)
    assert kv.get_block_ids("1") == []
