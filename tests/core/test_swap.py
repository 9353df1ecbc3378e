"""Swap preemption in the scheduler over a real KVCacheManager and host SwapSpace, with exact block
ids (no torch): swap out, swap in, the preemption rule, and aborts in every state freeing both tiers.

Device: 6 usable blocks of 4 tokens; host: 8 usable blocks. Two requests of 7-token prompts each
take 2 blocks, a third block at position 8 (step 3) and need a fourth at position 12 (step 7),
when the device pool is empty: the later one is preempted.
"""

from __future__ import annotations

import pytest
from swap_sim import SwapSim, rows

from paged_backend.core.request import RequestStatus
from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.core.swap import SWAP_MIN_TOKENS, SwapSpace


def run_to_swap(sim: SwapSim, a_max: int = 7, b_max: int = 14) -> SchedulerOutput:
    a = sim.add("a", list(range(100, 107)), a_max, 0.0)
    b = sim.add("b", list(range(200, 207)), b_max, 1.0)
    assert rows(sim.step()) == [("a", 0, 7, [1, 2]), ("b", 0, 7, [3, 4])]
    sim.step()
    assert rows(sim.step()) == [("a", 8, 1, [1, 2, 5]), ("b", 8, 1, [3, 4, 6])]
    for _ in range(3):
        sim.step()
    assert sim.kv.num_free_blocks == 0 and a.num_computed_tokens == b.num_computed_tokens == 12
    return sim.step()  # step 7: a needs a fourth block


def test_swap_out_then_in_without_recompute() -> None:
    sim = SwapSim()
    out = run_to_swap(sim)
    b = sim.reqs["b"]
    # b's three computed blocks go to host blocks 1..3; freed tail first (6, 4, 3), a takes 6
    assert out.preempted == ["b"]
    assert out.blocks_to_swap_out == [(3, 1), (4, 2), (6, 3)] and out.blocks_to_swap_in == []
    assert rows(out) == [("a", 12, 1, [1, 2, 5, 6])]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 12 and b.num_tokens == 13
    assert [r.request_id for r in sim.sched.swapped] == ["b"] and sim.sched.num_waiting == 0
    assert sim.kv.get_block_ids("b") == [] and sim.swap.host_block_ids("b") == [1, 2, 3]
    assert sim.swap.num_free_blocks == 5 and sim.sched.num_swap_preemptions == 1
    # a finished at that step (7 outputs): 6, 5, 2, 1 join the free queue after 4, 3
    assert sim.reqs["a"].is_finished
    assert [blk.block_id for blk in sim.kv.block_pool.free_block_queue.get_all_free_blocks()] == [4, 3, 6, 5, 2, 1]
    out = sim.step()
    # b resumes at position 12, nothing recomputed: its first two blocks (3, 4) are still cached on the device
    # and come back in place; its third (6) was a's meanwhile, so host block 3 is copied into a new block (6
    # again) and a fourth (5) follows; a's full block 5 is evicted for it and written back to the prefix tier
    # (b's own blocks are already there, cached when swapped out)
    assert rows(out) == [("b", 12, 1, [3, 4, 6, 5])]
    assert out.blocks_to_swap_in == [(3, 6)] and out.blocks_to_swap_out == [(5, 4)]
    assert b.status == RequestStatus.RUNNING and sim.swap.num_free_blocks == 8 and sim.swap.num_written_back_blocks == 1
    assert sim.swap.num_swapped_out_blocks == 3 and sim.swap.num_swapped_in_blocks == 1
    assert sim.swap.num_reused_in_place_blocks == 2
    while sim.sched.has_work():
        sim.step()
    assert b.num_output_tokens == 14 and b.num_preemptions == 1
    sim.assert_all_free()


def test_without_prefix_caching_every_block_comes_back_from_the_host_and_none_leaks() -> None:
    sim = SwapSim(caching=False)
    out = run_to_swap(sim)
    assert out.preempted == ["b"] and out.blocks_to_swap_out == [(3, 1), (4, 2), (6, 3)]
    out = sim.step()
    assert rows(out) == [("b", 12, 1, [4, 3, 6, 5])]
    assert out.blocks_to_swap_in == [(1, 4), (2, 3), (3, 6)] and out.blocks_to_swap_out == []
    assert sim.swap.num_free_blocks == 8 and sim.swap.num_reused_in_place_blocks == 0
    while sim.sched.has_work():
        sim.step()
    sim.assert_all_free()


def test_no_waiting_request_admitted_while_one_is_swapped_out() -> None:
    sim = SwapSim()
    run_to_swap(sim, a_max=14)
    sim.add("c", list(range(300, 307)), 2, 2.0)
    out = sim.step()  # a decodes in its fourth block; b cannot come back (needs 4, 0 free): c waits too
    assert rows(out) == [("a", 13, 1, [1, 2, 5, 6])]
    assert sim.sched.num_swapped == 1 and sim.sched.num_waiting == 1
    while sim.sched.num_swapped:
        out = sim.step()
    # once a has finished b resumes first: a took b's second block (4) meanwhile, so only the first (3) is still
    # cached on the device and comes back in place; the run stops there: host blocks 2 and 3 are copied in
    assert rows(out) == [("b", 12, 1, [3, 4, 6, 5]), ("c", 0, 7, [2, 1])]
    assert out.blocks_to_swap_in == [(2, 4), (3, 6)] and sim.swap.num_reused_in_place_blocks == 1
    while sim.sched.has_work():
        sim.step()
    sim.assert_all_free()


def test_abort_while_swapped_out_frees_the_host_blocks() -> None:
    sim = SwapSim()
    run_to_swap(sim, a_max=14)  # the abort comes right after the step that issued the swap-out copies
    sim.sched.finish(sim.reqs["b"], RequestStatus.FINISHED_ABORTED)
    assert sim.swap.num_free_blocks == 8 and sim.sched.num_swapped == 0 and sim.swap.host_block_ids("b") == []
    sim.sched.finish(sim.reqs["a"], RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()


def test_abort_in_the_step_that_swaps_in_frees_the_new_device_blocks() -> None:
    sim = SwapSim()
    run_to_swap(sim)
    out = sim.sched.schedule()  # b swapped in (two blocks in place, one from the host); abort before its step ran
    assert out.blocks_to_swap_in == [(3, 6)]
    assert sim.kv.get_block_ids("b") == [3, 4, 6, 5] and sim.swap.num_free_blocks == 8
    sim.sched.finish(sim.reqs["b"], RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()


def test_abort_while_running_after_a_swap_round_trip() -> None:
    sim = SwapSim()
    run_to_swap(sim)
    sim.step()
    sim.step()
    assert sim.reqs["b"].status == RequestStatus.RUNNING
    sim.sched.finish(sim.reqs["b"], RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()


@pytest.mark.parametrize(("mode", "min_tokens", "host_blocks", "swapped"), [
    ("recompute", 0, 9, False),   # never swaps
    (None, SWAP_MIN_TOKENS, 9, False),  # the default rule: 12 computed tokens are too few to pay for the copies
    (None, 12, 9, True),          # at the threshold it swaps
    ("swap", 0, 3, False),        # 3 blocks to copy, 2 usable host blocks: recompute instead
])
def test_preemption_rule(mode: str | None, min_tokens: int, host_blocks: int, swapped: bool) -> None:
    sim = SwapSim(host_blocks=host_blocks, mode=mode, min_tokens=min_tokens)
    out = run_to_swap(sim)
    b = sim.reqs["b"]
    assert out.preempted == ["b"]
    if swapped:
        assert b.status == RequestStatus.SWAPPED and out.blocks_to_swap_out == [(3, 1), (4, 2), (6, 3)]
    else:
        assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
        assert sim.sched.num_swapped == 0 and sim.swap.host_block_ids("b") == []
        # not a swap: only b's full block 6, evicted for a, is written back to the prefix tier
        assert out.blocks_to_swap_out == [(6, 1)]
        assert [r.request_id for r in sim.sched.waiting] == ["b"]
    while sim.sched.has_work():
        sim.step()
    assert b.num_output_tokens == 14
    sim.assert_all_free()


def test_swap_space_pool_accounting() -> None:
    swap = SwapSpace(5, 4)
    assert swap.num_total_usable == 4 and swap.blocks_needed(9) == 3
    assert swap.swap_out("x", [7, 3]) == [(7, 1), (3, 2)]
    with pytest.raises(ValueError):
        swap.swap_out("x", [1])
    with pytest.raises(ValueError):
        swap.swap_out("y", [1, 2, 5])  # 2 free host blocks
    assert swap.swap_in("x", [9, 4, 8]) == [(1, 9), (2, 4)]
    assert swap.num_free_blocks == 2  # until the step's plan is made: its copies read them
    assert swap.take_copies() == ([], []) and swap.num_free_blocks == 4
    swap.free("x")  # not swapped: a no-op
    with pytest.raises(ValueError):
        SwapSpace(5, 4, "sometimes")
