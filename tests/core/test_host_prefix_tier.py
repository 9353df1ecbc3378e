"""The host tier as the prefix cache's second tier, over the real KVCacheManager, SwapSpace and Scheduler
with exact block ids (no torch): evicted cached blocks are written back to the host, a lookup that
misses on the device continues on the host and copies the blocks back, LRU on the host, the accounting
of both pools, and aborts in every state leaving both pools whole.

Device: 4 usable blocks of 4 tokens; host: 3 usable blocks.
"""

from __future__ import annotations

from swap_sim import SwapSim, rows

from paged_backend.core.block_hash import hash_block_tokens
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.swap import SwapSpace
from paged_backend.sampling_params import SamplingParams

BS = 4


def tier_sim(device_blocks: int = 5, host_blocks: int = 4) -> SwapSim:
    """Preemption by recompute: here the host tier is the prefix cache's."""
    return SwapSim(device_blocks=device_blocks, host_blocks=host_blocks, mode="recompute", block_size=BS)


A = list(range(9))  # two full blocks and one token
B = list(range(100, 113))  # three full blocks and one token


def evict_a(sim: SwapSim) -> None:
    """a runs and finishes (its two full blocks stay cached on the device), then b takes every device
    block: a's cached blocks 2 and 1 are evicted and written back to host blocks 1 and 2."""
    sim.add("a", A, 1)
    out = sim.step()
    assert rows(out) == [("a", 0, 9, [1, 2, 3])] and out.blocks_to_swap_out == []
    sim.add("b", B, 1)
    out = sim.step()
    assert rows(out) == [("b", 0, 13, [4, 3, 2, 1])]
    assert out.blocks_to_swap_out == [(2, 1), (1, 2)] and out.blocks_to_swap_in == []
    assert sim.swap.num_written_back_blocks == 2


def test_evicted_blocks_are_written_back_and_a_host_hit_copies_them_back() -> None:
    sim = tier_sim()
    evict_a(sim)
    h0 = hash_block_tokens(None, A[:4])
    assert sim.kv.block_pool.get_cached_block(h0) is None  # gone from the device...
    assert sim.swap.pool.get_cached_block(h0).block_id == 2  # ...kept on the host
    c = sim.add("c", A, 1)  # the same prompt again: no device hit, two blocks on the host
    out = sim.step()
    # c computes its last token only, in fresh device blocks 1, 2, 3: blocks 1 and 2 are filled from host
    # blocks 2 and 1. Taking device block 2 evicts b's cached block 2, written back to the last free host
    # block 3 first (the runner copies out before in); b's cached block 3 finds no free host block (1 and 2
    # are held by this step's copies) and is dropped
    assert rows(out) == [("c", 8, 1, [1, 2, 3])]
    assert out.blocks_to_swap_in == [(2, 1), (1, 2)]
    assert out.blocks_to_swap_out == [(2, 3)]
    assert c.num_cached_tokens == 8
    # the device blocks are cached under the same chain: a request for the same prefix now hits on the device
    assert sim.kv.block_pool.get_cached_block(h0).block_id == 1
    assert sim.swap.num_loaded_blocks == 2 and sim.swap.num_written_back_blocks == 3
    # stats: every prompt looked up in both tiers; 8 tokens hit, all on the host
    assert (sim.kv.stats.queries, sim.kv.stats.hits) == (9 + 13 + 9, 0)
    assert (sim.swap.stats.queries, sim.swap.stats.hits) == (9 + 13 + 9, 8)
    sim.assert_all_free()
    d = sim.add("d", A, 1)
    out = sim.step()
    assert rows(out) == [("d", 8, 1, [1, 2, 4])] and out.blocks_to_swap_in == []
    # b's first block, evicted from device block 4, replaces the host's least recent block (a's first,
    # held by the last step's copy and back on the device since)
    assert out.blocks_to_swap_out == [(4, 2)]
    assert sim.kv.stats.hits == 8 and d.num_cached_tokens == 8
    sim.assert_all_free()


def test_host_tier_is_lru_and_keeps_one_copy_per_hash() -> None:
    swap = SwapSpace(4, BS)
    h = [hash_block_tokens(None, [i] * BS) for i in range(5)]
    for dev, hh in zip((7, 8, 9), h, strict=False):
        swap.write_back(dev, hh)
    assert swap.take_copies() == ([(7, 1), (8, 2), (9, 3)], [])
    swap.write_back(5, h[0])  # already here: no copy, only made the most recent
    swap.write_back(6, h[3])  # host full: its least recent block (h[1] in host block 2) is evicted for it
    assert swap.take_copies() == ([(6, 2)], [])
    assert [b.block_id for b in swap.lookup(h[:1])] == [1] and swap.lookup(h[1:2]) == []
    assert [b.block_id for b in swap.lookup([h[2], h[3], h[4]])] == [3, 2]
    assert [b.block_id for b in swap.pool.free_block_queue.get_all_free_blocks()] == [3, 1, 2]
    # within one step a host block is written once: with every host block taken by this step's copies,
    # further write-backs are dropped
    swap.write_back(10, h[4])
    swap.hold(swap.lookup([h[0], h[3]]))
    swap.write_back(11, hash_block_tokens(None, [99] * BS))
    assert swap.take_copies() == ([(10, 3)], [])
    assert swap.num_free_blocks == swap.num_total_usable == 3
    assert swap.reset_prefix_cache() and swap.lookup(h) == []


def test_swapped_out_blocks_serve_prefix_hits_and_are_not_written_back_twice() -> None:
    sim = tier_sim()
    sim.swap.mode = "swap"
    a = sim.add("a", list(range(8)), max_tokens=8)
    b = sim.add("b", B[:5], 4)
    assert rows(sim.step()) == [("a", 0, 8, [1, 2]), ("b", 0, 5, [3, 4])]
    out = sim.step()  # a needs a block at position 8: b, the later arrival, is swapped out
    assert out.preempted == ["b"] and out.blocks_to_swap_out == [(3, 1), (4, 2)]
    assert rows(out) == [("a", 8, 1, [1, 2, 4])]
    sim.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert sim.swap.num_free_blocks == 3
    # a reaches position 12 and takes device block 3 (b's cached full block): its hash is on the host
    # already (cached there by the swap out), so nothing is written back
    while len(sim.kv.get_block_ids("a")) < 4:
        out = sim.step()
    assert rows(out) == [("a", 12, 1, [1, 2, 4, 3])] and out.blocks_to_swap_out == []
    while not a.is_finished:
        sim.step()
    c = sim.add("c", B[:5], 1)  # b's prompt: its first block comes back from the host block the swap out filled
    out = sim.step()
    assert out.blocks_to_swap_in == [(1, rows(out)[0][3][0])] and c.num_cached_tokens == 4
    sim.assert_all_free()


def test_aborts_in_every_state_leave_both_pools_whole() -> None:
    # abort in the step that copies host blocks in (before its forward ran)
    sim = tier_sim()
    evict_a(sim)
    c = sim.add("c", A, max_tokens=4)
    out = sim.sched.schedule()
    assert out.blocks_to_swap_in == [(2, 1), (1, 2)]
    sim.sched.finish(c, RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()
    # the host copies are cached: a later request still hits there (or on the device, where they landed)
    d = sim.add("d", A, 1)
    sim.step()
    assert d.num_cached_tokens == 8
    sim.assert_all_free()
    # abort while waiting, after a lookup found host blocks but the device pool had no room
    sim2 = tier_sim()
    evict_a(sim2)
    hog = sim2.add("hog", list(range(500, 515)), max_tokens=20)
    sim2.step()
    e = sim2.add("e", A, 1)
    out = sim2.step()
    assert [s.request_id for s in out.scheduled] == ["hog"] and e.status == RequestStatus.WAITING
    sim2.sched.finish(e, RequestStatus.FINISHED_ABORTED)
    sim2.sched.finish(hog, RequestStatus.FINISHED_ABORTED)
    sim2.assert_all_free()


def test_swap_outs_of_a_step_that_schedules_nothing_run_with_the_next_step() -> None:
    """A fork shares every block of its parent, so swapping it out frees nothing: the parent is swapped
    out too and the step schedules nothing (the engine runs no step then); its copies come first in the
    next step that runs."""
    sim = tier_sim(device_blocks=4, host_blocks=8)
    sim.swap.mode = "swap"
    a = sim.add("a", list(range(12)), max_tokens=4)
    sim.step()  # a: 1 2 3, full
    child = Request("a#1", list(range(12)), SamplingParams(), max_tokens=4, arrival_time=5.0)
    child.append_output_token(901)
    child.num_computed_tokens = 12
    sim.reqs["a#1"] = child
    sim.kv.fork(a, child)
    sim.sched.add_running(child)
    out = sim.sched.schedule()  # a needs a fourth block: the child, then a itself, are swapped out
    assert out.preempted == ["a#1", "a"] and out.scheduled == []
    assert out.blocks_to_swap_out == [] and sim.kv.num_free_blocks == 3
    for req in (a, child):  # neither fits again beside the other: give up both
        sim.sched.finish(req, RequestStatus.FINISHED_ABORTED)
    sim.add("e", [7, 7, 7], 1)
    out = sim.step()
    assert rows(out) == [("e", 0, 3, [3])]
    assert out.blocks_to_swap_out == [(1, 1), (2, 2), (3, 3), (1, 4), (2, 5), (3, 6)]
    sim.assert_all_free()
