"""Speculative decoding in the scheduler: 1 + k tokens for a request with k drafts, the caps on k,
and the rollback of rejected drafts (computed tokens and blocks), with exact block ids (no torch)."""

from __future__ import annotations

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import Scheduler
from paged_backend.sampling_params import SamplingParams


def setup(num_blocks: int = 11, budget: int = 64, max_model_len: int = 64):
    kv = KVCacheManager(num_blocks, 4, True)
    return kv, Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len)


def make(req_id: str, prompt_len: int, first: int, max_tokens: int = 20) -> Request:
    return Request(req_id, list(range(first, first + prompt_len)), SamplingParams(), max_tokens=max_tokens)


def verify(sched: Scheduler, req: Request, emitted: list[int], num_draft: int) -> None:
    """What the engine does with a verification step's result: roll back, then append."""
    sched.rollback_drafts(req, num_draft - (len(emitted) - 1))
    for t in emitted:
        req.append_output_token(t)


def prefill(kv, sched, req):
    sched.add_request(req)
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [req.num_prompt_tokens]
    req.append_output_token(500)


def test_drafts_scheduled_with_the_last_token_and_rejected_blocks_freed():
    kv, sched = setup()
    req = make("a", 3, 0)
    prefill(kv, sched, req)
    assert kv.get_block_ids("a") == [1]
    req.spec_token_ids = [7, 8, 9, 10]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start_pos, s.num_new_tokens, s.num_draft, s.token_ids, s.samples) == (3, 5, 4, [500, 7, 8, 9, 10], True)
    assert out.num_tokens == 5 and out.num_draft_tokens == 4
    assert s.block_ids == [1, 2]  # positions 3..7 cross into a second block
    free_before = kv.num_free_blocks
    verify(sched, req, [600], 4)  # the first draft rejected: only the last token's position stays
    assert req.num_computed_tokens == 4 and req.num_tokens == 5 and req.spec_token_ids == []
    assert kv.get_block_ids("a") == [1]
    assert kv.num_free_blocks == free_before + 1
    # the next decode step (no drafts) writes position 4 into a fresh block (block 2 went to the
    # free queue's tail)
    out = sched.schedule()
    assert [(x.start_pos, x.num_new_tokens, x.block_ids) for x in out.scheduled] == [(4, 1, [1, 3])]


def test_all_drafts_accepted_keep_their_blocks():
    kv, sched = setup()
    req = make("a", 3, 0)
    prefill(kv, sched, req)
    req.spec_token_ids = [7, 8, 9]
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4
    verify(sched, req, [7, 8, 9, 11], 3)
    assert req.num_computed_tokens == 7 and req.output_token_ids == [500, 7, 8, 9, 11]
    assert kv.get_block_ids("a") == [1, 2]
    out = sched.schedule()
    assert [(x.start_pos, x.num_new_tokens, x.block_ids) for x in out.scheduled] == [(7, 1, [1, 2])]


def test_rejected_tokens_are_never_hashed_into_the_prefix_cache():
    kv, sched = setup()
    req = make("a", 3, 0)
    prefill(kv, sched, req)
    req.spec_token_ids = [7, 8, 9, 10, 11]
    sched.schedule()  # positions 3..8: block 1 full of known tokens only up to position 3
    assert len(req.block_hashes) == 1  # [0, 1, 2, 500]: known, computed
    verify(sched, req, [7, 13], 5)  # draft 7 kept, then 13: block 2 would hold 8.. if hashed
    assert len(req.block_hashes) == 1
    assert kv.get_block_ids("a") == [1, 2]  # position 4 (draft 7) is kept in block 2
    assert kv.block_pool.get_cached_block(req.block_hashes[0]) is not None


def test_drafts_capped_by_budget_max_tokens_and_max_model_len():
    kv, sched = setup(budget=3)
    req = make("a", 3, 0)
    sched.add_request(req)
    sched.schedule()  # chunk of 3: the whole prompt
    req.append_output_token(500)
    req.spec_token_ids = [7, 8, 9, 10]
    (s,) = sched.schedule().scheduled
    assert (s.num_new_tokens, s.num_draft) == (3, 2) and req.spec_token_ids == [7, 8]

    kv, sched = setup()
    req = make("b", 3, 0, max_tokens=3)
    prefill(kv, sched, req)
    req.spec_token_ids = [7, 8, 9, 10]
    (s,) = sched.schedule().scheduled
    assert s.num_draft == 1  # one output so far: one draft and the token after it reach max_tokens

    kv, sched = setup(max_model_len=16)
    req = make("c", 13, 0)
    prefill(kv, sched, req)
    req.spec_token_ids = [7, 8, 9, 10]
    (s,) = sched.schedule().scheduled
    assert s.num_draft == 1  # 14 tokens: one draft and the token after it reach 16


def test_drafts_dropped_when_their_blocks_do_not_fit():
    kv, sched = setup(num_blocks=3)  # blocks 1 and 2
    a, b = make("a", 3, 0), make("b", 3, 100)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    a.append_output_token(500)
    b.append_output_token(501)
    a.spec_token_ids = [7, 8]
    out = sched.schedule()
    assert [(x.request_id, x.num_new_tokens, x.num_draft, x.block_ids) for x in out.scheduled] == [
        ("a", 1, 0, [1]), ("b", 1, 0, [2])]
    assert not out.preempted and a.spec_token_ids == []


def test_preemption_forgets_the_drafts_and_abort_frees_everything():
    kv, sched = setup(num_blocks=3)  # blocks 1 and 2
    a, b = make("a", 4, 0), make("b", 3, 100)
    a.arrival_time, b.arrival_time = 0.0, 1.0
    for r in (a, b):
        sched.add_request(r)
    sched.schedule()
    a.append_output_token(500)
    b.append_output_token(501)
    b.spec_token_ids = [7, 8]
    out = sched.schedule()  # a's position 4 needs a block: b (newest) is preempted
    assert out.preempted == ["b"] and b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert [(x.request_id, x.num_new_tokens, x.block_ids) for x in out.scheduled] == [("a", 1, [1, 2])]
    a.append_output_token(502)
    a.spec_token_ids = [1, 2]
    out = sched.schedule()
    assert [(x.request_id, x.num_new_tokens, x.num_draft) for x in out.scheduled] == [("a", 3, 2)]
    sched.finish(a, RequestStatus.FINISHED_ABORTED)  # aborted before its drafts are verified
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.block_pool.num_total_usable
    sched.rollback_drafts(a, 2)  # a late rollback of a finished request changes nothing
    assert kv.num_free_blocks == kv.block_pool.num_total_usable
