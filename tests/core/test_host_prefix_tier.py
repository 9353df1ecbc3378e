"""The host tier as the prefix cache's second tier, over the real KVCacheManager, SwapSpace and Scheduler
with exact block ids (no torch): evicted cached blocks are written back to the host, a lookup takes each
block of its chain from the device when it is there and from the host otherwise (copied back), LRU on the
host, the accounting of both pools, aborts in every state leaving both pools whole, and random walks that
keep what every block of both tiers holds, copied in the runner's order.

Blocks of 4 tokens; device: 4 usable blocks, host: 3 (unless a test says otherwise).
"""

from __future__ import annotations

import random

from swap_sim import SwapSim, rows

from paged_backend.core.block_hash import hash_block_tokens
from paged_backend.core.request import Request, RequestStatus
from paged_backend.core.scheduler import SchedulerOutput
from paged_backend.core.swap import SwapSpace
from paged_backend.sampling_params import SamplingParams

BS = 4


def host_id(swap: SwapSpace, block_hash) -> int | None:
    """The host block cached under ``block_hash``, or None."""
    block = swap.pool.get_cached_block(block_hash)
    return None if block is None else block.block_id


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
    assert [host_id(swap, hh) for hh in h] == [1, None, 3, 2, None]
    assert [b.block_id for b in swap.pool.free_block_queue.get_all_free_blocks()] == [3, 1, 2]
    # within one step a host block is written once: with every host block taken by this step's copies,
    # further write-backs are dropped
    swap.write_back(10, h[4])
    swap.hold([swap.pool.get_cached_block(h[0]), swap.pool.get_cached_block(h[3])])
    swap.write_back(11, hash_block_tokens(None, [99] * BS))
    assert swap.take_copies() == ([(10, 3)], [])
    assert swap.num_free_blocks == swap.num_total_usable == 3
    assert swap.reset_prefix_cache() and [host_id(swap, hh) for hh in h] == [None] * 5


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


# ---- a chain served part from the device, part from the host -------------------------------------------
# A lookup walks the chain block by block: the device block when the device pool holds the hash, else the
# host block, stopping at the first block in neither. Gaps in the device's copy of a chain come from a
# request asking for prompt logprobs: it skips the lookup and computes every block itself, and a block whose
# hash the device already holds elsewhere stays uncached (the older entry wins), so the chain's device
# blocks can be freed, hence evicted, in an order other than tail first.

T = list(range(13))  # three full blocks and one token


def chain(tokens: list[int], n: int) -> list:
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS])
        hashes.append(parent)
    return hashes


H = chain(T, 3)


def tiers(sim: SwapSim) -> list[tuple[int | None, int | None]]:
    """(device block, host block) holding each block of T's chain, None where that tier misses it."""
    dev = [sim.kv.block_pool.get_cached_block(h) for h in H]
    return [(None if d is None else d.block_id, host_id(sim.swap, h)) for d, h in zip(dev, H, strict=True)]


def add_logprobs_request(sim: SwapSim, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    req = Request(req_id, tokens, SamplingParams(prompt_logprobs=1), max_tokens=max_tokens,
                  arrival_time=float(len(sim.reqs)))
    sim.reqs[req_id] = req
    sim.sched.add_request(req)
    return req


def device_free_ids(sim: SwapSim) -> list[int]:
    return [b.block_id for b in sim.kv.block_pool.free_block_queue.get_all_free_blocks()]


def host_free_ids(sim: SwapSim) -> list[int]:
    return [b.block_id for b in sim.swap.pool.free_block_queue.get_all_free_blocks()]


def gap_sim(host_blocks: int = 4) -> SwapSim:
    """T's chain with blocks 0 and 2 on the device (blocks 1 and 6) and block 1 on the host only (host block 1).

    y computes blocks 0 and 1 (device 1, 2); p, asking for prompt logprobs, computes the whole chain in 4 5 6
    7: 4 and 5 stay uncached (1 and 2 hold those hashes), 6 is cached under block 2's hash. y's blocks are
    freed before p's, so a filler taking two blocks evicts y's partial block 3 and block 2 (written back)."""
    sim = tier_sim(device_blocks=8, host_blocks=host_blocks)
    sim.add("y", T[:9], 1)
    assert rows(sim.step()) == [("y", 0, 9, [1, 2, 3])]
    add_logprobs_request(sim, "p", T)
    assert rows(sim.step()) == [("p", 0, 13, [4, 5, 6, 7])]
    assert device_free_ids(sim) == [3, 2, 1, 7, 6, 5, 4]
    sim.add("f", list(range(200, 205)), 1)
    out = sim.step()
    assert rows(out) == [("f", 0, 5, [3, 2])] and out.blocks_to_swap_out == [(2, 1)]
    assert tiers(sim) == [(1, None), (None, 1), (6, None)]
    return sim


def test_a_gap_in_the_device_chain_is_loaded_from_the_host_and_the_blocks_after_it_used_in_place() -> None:
    sim = gap_sim()
    dev_stats, host_stats = (sim.kv.stats.queries, sim.kv.stats.hits), (sim.swap.stats.queries, sim.swap.stats.hits)
    z = sim.add("z", T[:12] + [77], 1)
    out = sim.step()
    # block 0 in device block 1, block 1 loaded from host block 1 into the next new device block (7), block 2
    # in device block 6 in place (no copy), a new block 5 for the last token: only that token is computed
    assert rows(out) == [("z", 12, 1, [1, 7, 6, 5])]
    assert out.blocks_to_swap_in == [(1, 7)] and out.blocks_to_swap_out == []
    assert z.num_cached_tokens == 12 and sim.swap.num_loaded_blocks == 1
    # counted once each, in the tier that served it; both tiers record the lookup's 13 prompt tokens as queries
    assert (sim.kv.stats.queries - dev_stats[0], sim.kv.stats.hits - dev_stats[1]) == (13, 8)
    assert (sim.swap.stats.queries - host_stats[0], sim.swap.stats.hits - host_stats[1]) == (13, 4)
    # the loaded block is cached on the device under block 1's hash; the host keeps its copy
    assert tiers(sim) == [(1, None), (7, 1), (6, None)]
    sim.assert_all_free()
    # a block on both tiers is taken from the device: the whole chain is a device hit, nothing is copied
    z2 = sim.add("z2", T[:12] + [78], 1)
    out = sim.step()
    assert rows(out) == [("z2", 12, 1, [1, 7, 6, 4])] and out.blocks_to_swap_in == []
    assert z2.num_cached_tokens == 12 and sim.swap.stats.hits - host_stats[1] == 4
    assert sim.kv.stats.hits - dev_stats[1] == 8 + 12
    sim.assert_all_free()


def test_a_block_on_both_tiers_after_a_host_hit_is_used_on_the_device() -> None:
    """T's chain with block 0 on the host only, block 1 on both tiers, block 2 on the device."""
    sim = tier_sim(device_blocks=7, host_blocks=6)
    x = sim.add("x", T[:9], 1)
    assert rows(sim.step()) == [("x", 0, 9, [1, 2, 3])] and x.is_finished
    r = sim.add("r", T[:4] + [50], 10)  # holds block 0 (device block 1) while f and p run
    assert rows(sim.step()) == [("r", 4, 1, [1, 4])]
    sim.add("f", list(range(200, 213)), 1)
    out = sim.step()
    assert rows(out)[1] == ("f", 0, 13, [5, 6, 3, 2]) and out.blocks_to_swap_out == [(2, 1)]
    p = add_logprobs_request(sim, "p", T, max_tokens=10)
    out = sim.step()  # p's block 1 (device 3) is cached again on the device: block 1 is on both tiers now
    assert rows(out)[1] == ("p", 0, 13, [2, 3, 6, 5])
    assert tiers(sim) == [(1, None), (3, 1), (6, None)]
    sim.sched.finish(r, RequestStatus.FINISHED_ABORTED)  # block 0's device block is freed before p's blocks
    sim.sched.finish(p, RequestStatus.FINISHED_ABORTED)
    assert device_free_ids(sim) == [4, 1, 5, 6, 3, 2]
    sim.add("g", [300] * 5, 1)
    out = sim.step()
    assert rows(out) == [("g", 0, 5, [4, 1])] and out.blocks_to_swap_out == [(1, 5)]
    assert tiers(sim) == [(None, 5), (3, 1), (6, None)]
    host_lru = host_free_ids(sim)
    z = sim.add("z", T[:12] + [77], 1)
    out = sim.step()
    # block 0 from host block 5 into new device block 5; blocks 1 and 2 in place (block 1's host copy unread)
    assert rows(out) == [("z", 12, 1, [5, 3, 6, 2])] and out.blocks_to_swap_in == [(5, 5)]
    assert z.num_cached_tokens == 12
    assert host_free_ids(sim) == host_lru  # host block 1 was not touched: only host block 5, read and freed
    assert tiers(sim) == [(5, 5), (3, 1), (6, None)]
    sim.assert_all_free()


def test_the_walk_stops_at_the_first_block_in_neither_tier() -> None:
    """Block 1 of T's chain is evicted from the device with the host tier full of the step's own copies, so
    it is dropped: block 2, still on the device, is not used (its chain is broken)."""
    sim = tier_sim(device_blocks=9, host_blocks=2)
    sim.add("y", T[:8] + [60, 61, 62, 63, 64], 1)  # blocks 0 and 1 of T's chain, then one of its own
    assert rows(sim.step()) == [("y", 0, 13, [1, 2, 3, 4])]
    add_logprobs_request(sim, "p", T)
    assert rows(sim.step()) == [("p", 0, 13, [5, 6, 7, 8])]
    sim.add("f", list(range(200, 209)), 1)
    out = sim.step()  # evicts y's block 3 (written back to the only host block) and block 2 (dropped)
    assert rows(out) == [("f", 0, 9, [4, 3, 2])] and out.blocks_to_swap_out == [(3, 1)]
    assert tiers(sim) == [(1, None), (None, None), (7, None)]
    host_queries = sim.swap.stats.queries
    z = sim.add("z", T[:12] + [77], 1)
    out = sim.step()
    assert rows(out)[0][:3] == ("z", 4, 9) and out.blocks_to_swap_in == []
    assert z.num_cached_tokens == 4 and sim.swap.stats.queries - host_queries == 13
    sim.assert_all_free()


def refs(sim: SwapSim, ids: list[int]) -> list[int]:
    return [sim.kv.block_pool.blocks[i].ref_cnt for i in ids]


def test_aborts_mid_a_mixed_chain_leave_both_pools_whole() -> None:
    # two requests on the chain in one step, one aborted right after the step that loaded its host block:
    # the second finds the loaded block on the device (cached at the first one's allocation) and shares all three
    sim = gap_sim()
    z1 = sim.add("z1", T[:12] + [77], 4)
    z2 = sim.add("z2", T[:12] + [78], 4)
    out = sim.sched.schedule()
    assert rows(out) == [("z1", 12, 1, [1, 7, 6, 5]), ("z2", 12, 1, [1, 7, 6, 4])]
    assert out.blocks_to_swap_in == [(1, 7)] and z2.num_cached_tokens == 12
    assert refs(sim, [1, 7, 6, 5, 4]) == [2, 2, 2, 1, 1]
    assert sim.swap.num_free_blocks == sim.swap.num_total_usable  # the held host block is free once planned
    sim.sched.finish(z1, RequestStatus.FINISHED_ABORTED)
    assert refs(sim, [1, 7, 6, 5, 4]) == [1, 1, 1, 0, 1]
    sim.sched.finish(z2, RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()
    assert tiers(sim) == [(1, None), (7, 1), (6, None)]

    # a mixed lookup whose allocation fails (43 tokens need 11 blocks of 7): nothing is held or moved, the
    # lookup is counted all the same (hits at lookup time, as for the device tier), and the abort frees nothing
    sim = gap_sim()
    dev_lru, host_lru = device_free_ids(sim), host_free_ids(sim)
    hits = sim.kv.stats.hits, sim.swap.stats.hits
    w = sim.add("w", T[:12] + list(range(400, 431)), 1)
    out = sim.step()
    assert out.scheduled == [] and out.blocks_to_swap_in == [] and w.status == RequestStatus.WAITING
    assert (device_free_ids(sim), host_free_ids(sim)) == (dev_lru, host_lru)
    assert (sim.kv.stats.hits - hits[0], sim.swap.stats.hits - hits[1]) == (8, 4)
    sim.sched.finish(w, RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()
    assert (device_free_ids(sim), host_free_ids(sim)) == (dev_lru, host_lru)

    # aborted mid prefill: the chain loaded and its first chunk scheduled, 5 tokens left
    sim = gap_sim()
    sim.sched.max_num_batched_tokens = 4
    c = sim.add("c", T[:12] + list(range(400, 409)), 1)
    out = sim.step()
    assert rows(out) == [("c", 12, 4, [1, 7, 6, 5])] and out.blocks_to_swap_in == [(1, 7)]
    sim.sched.finish(c, RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()
    # the chain and the chunk's block stay cached: the same prompt now hits 16 tokens on the device
    d = sim.add("d", T[:12] + list(range(400, 409)), 1)
    out = sim.step()
    assert rows(out)[0][:3] == ("d", 16, 4) and out.blocks_to_swap_in == [] and d.num_cached_tokens == 16
    sim.sched.finish(d, RequestStatus.FINISHED_ABORTED)
    sim.assert_all_free()


def test_a_block_written_back_is_loaded_by_a_later_request_of_the_same_step() -> None:
    """The runner's order (swap out, then swap in) is what makes a step right whose loads read host blocks
    that its own write-backs fill, into device blocks that those write-backs read."""
    sim = tier_sim(device_blocks=10, host_blocks=6)
    sim.add("a", A, 1)
    assert rows(sim.step()) == [("a", 0, 9, [1, 2, 3])]
    sim.add("x", list(range(300, 309)), 1)
    assert rows(sim.step()) == [("x", 0, 9, [4, 5, 6])]
    sim.add("b", list(range(100, 121)), 1)
    c = sim.add("c", A, 1)
    out = sim.step()
    # b's blocks evict a's (written back to host blocks 1 and 2); c, later in the same step, finds a's chain on
    # the host and loads it into x's evicted blocks 6 and 5 (5 also the source of a write-back)
    assert rows(out) == [("b", 0, 21, [7, 8, 9, 3, 2, 1]), ("c", 8, 1, [6, 5, 4])]
    assert out.blocks_to_swap_out == [(2, 1), (1, 2), (5, 3), (4, 4)]
    assert out.blocks_to_swap_in == [(2, 6), (1, 5)] and c.num_cached_tokens == 8
    sim.assert_all_free()


# ---- random walks: what every block holds --------------------------------------------------------------


class ShadowKV:
    """What each device and host slot holds, written as the runner would: swap outs, swap ins, copy-on-write,
    then the forward's tokens. Checked after every step against the requests' tokens and the cached hashes."""

    def __init__(self, sim: SwapSim) -> None:
        self.sim = sim
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.hash_tokens: dict[bytes, list[int]] = {}

    def run(self, out: SchedulerOutput) -> None:
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self.device.get(dev, [None] * BS))
        for host, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.host.get(host, [None] * BS))
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device.get(src, [None] * BS))
        for s in out.scheduled:
            for i, token in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.device.setdefault(s.block_ids[pos // BS], [None] * BS)[pos % BS] = token
            req = self.sim.reqs[s.request_id]
            for i, block_hash in enumerate(req.block_hashes):
                self.hash_tokens[block_hash] = req.all_token_ids[i * BS:(i + 1) * BS]

    def check(self) -> None:
        sim = self.sim
        kv, swap = sim.kv, sim.swap
        holders: dict[int, int] = {}
        for req in sim.sched.running:
            ids = kv.req_block_ids[req.request_id]
            for pos in range(req.num_computed_tokens):
                assert self.device[ids[pos // BS]][pos % BS] == req.all_token_ids[pos], (req.request_id, pos)
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for req in sim.sched.swapped:
            ids = swap.host_block_ids(req.request_id)
            for pos in range(req.num_computed_tokens):
                assert self.host[ids[pos // BS]][pos % BS] == req.all_token_ids[pos], (req.request_id, pos)
        assert all(b.ref_cnt == holders.get(b.block_id, 0) for b in kv.block_pool.blocks)
        host_held = sum(len(swap.host_block_ids(r.request_id)) for r in sim.sched.swapped)
        assert swap.num_free_blocks == swap.num_total_usable - host_held
        for tier, pool in ((self.device, kv.block_pool), (self.host, swap.pool)):
            for block_hash, block in pool.cached_blocks.items():
                assert tier[block.block_id] == self.hash_tokens[block_hash], block


def test_random_walks_keep_every_block_right_in_both_tiers() -> None:
    """Random prompts over three shared documents (some asking for prompt logprobs, so skipping the lookup),
    small token budgets, decode, aborts, preemption by recompute or swap: every computed token of every
    running or swapped request is in its block, every cached block of either tier holds its hash's tokens,
    ref counts match the holders, and the chain walks mix the tiers (counted, so the walk is exercised)."""
    mixed = 0
    for seed in range(6):
        rng = random.Random(seed)
        sim = tier_sim(device_blocks=12, host_blocks=8)
        if seed % 2:
            sim.swap.mode, sim.swap.min_tokens = "swap", 1
        shadow = ShadowKV(sim)
        walk = sim.kv.get_host_computed_blocks

        def counting_walk(req: Request, n: int, walk=walk, sim=sim) -> list:
            nonlocal mixed
            more = walk(req, n)
            owns = sim.kv.block_pool.owns
            kinds = "".join("d" if owns(b) else "h" for b in more)
            mixed += "hd" in kinds
            return more

        sim.kv.get_host_computed_blocks = counting_walk
        docs = [[rng.randrange(3) for _ in range(16)] for _ in range(3)]
        for _ in range(200):
            action = rng.random()
            if action < 0.3:
                prompt = rng.choice(docs)[:rng.randrange(4, 17)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
                req = Request(f"r{len(sim.reqs)}", prompt,
                              SamplingParams(prompt_logprobs=1 if rng.random() < 0.25 else None),
                              max_tokens=rng.randrange(1, 6), arrival_time=float(len(sim.reqs)))
                sim.reqs[req.request_id] = req
                sim.sched.add_request(req)
            elif action < 0.4:
                live = [r for r in sim.reqs.values() if not r.is_finished]
                if live:
                    sim.sched.finish(rng.choice(live), RequestStatus.FINISHED_ABORTED)
            else:
                sim.sched.max_num_batched_tokens = rng.choice((4, 8, 64))
                out = sim.sched.schedule()
                shadow.run(out)
                for s in out.scheduled:
                    req = sim.reqs[s.request_id]
                    if s.samples:
                        req.append_output_token(rng.randrange(3))
                        if req.num_output_tokens >= req.max_tokens:
                            sim.sched.finish(req, RequestStatus.FINISHED_LENGTH)
            shadow.check()
        for req in sim.reqs.values():
            sim.sched.finish(req, RequestStatus.FINISHED_ABORTED)
        sim.assert_all_free()
    assert mixed > 0
