"""Hypothesis state machine: random add/schedule/decode/fork/free/preempt keep the allocator's invariants.

A shadow model records the token written into every KV slot (block id, offset), so a prefix
hit or a copy-on-write bug shows up as a block whose recorded content differs from the tokens
of the request (or hash) that claims it.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request
from paged_backend.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 10  # 9 usable: small enough that requests get preempted and cached blocks evicted
VOCAB = 3  # a tiny vocabulary, and prompts that start with a few shared "documents", so prefixes hit
DOCUMENTS = ([0] * 12, [1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [2, 2, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0])
PROMPTS = st.builds(
    lambda doc, n, tail: doc[:n] + tail,
    st.sampled_from(DOCUMENTS),
    st.integers(0, 12),
    st.lists(st.integers(0, VOCAB - 1), max_size=6),
).filter(bool)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AllocatorMachine(RuleBasedStateMachine):
    """Plays the scheduler + model runner against a KVCacheManager and checks it after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.slots: dict[int, list[int | None]] = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.hash_tokens: dict[bytes, list[int]] = {}  # what each block hash stands for
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------------------

    def _new_request(self, prompt: list[int], salt: str | None) -> Request:
        self.next_id += 1
        return Request(f"r{self.next_id}", prompt, SamplingParams(), max_tokens=64, cache_salt=salt)

    def _snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return (
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            dict(pool.cached_blocks),
            {rid: self.mgr.get_block_ids(rid) for rid in [*self.waiting, *self.running]},
        )

    def _record_hashes(self, req: Request) -> None:
        for i, h in enumerate(req.block_hashes):
            tokens = req.all_token_ids[i * BS : (i + 1) * BS]
            assert self.hash_tokens.setdefault(h, tokens) == tokens, "one hash, two contents"

    def _forward(self, req: Request, start: int, end: int) -> None:
        """The model runner: do pending KV copies, then write tokens [start, end) into their slots."""
        for src, dst in self.mgr.take_pending_copies():
            event("copy-on-write")
            self.slots[dst] = list(self.slots[src])
        block_ids = self.mgr.get_block_ids(req.request_id)
        for pos in range(start, end):
            block = self.mgr.block_pool.blocks[block_ids[pos // BS]]
            assert block.ref_cnt == 1, f"write into shared {block} (missing copy-on-write)"
            self.slots[block.block_id][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens = end
        self._record_hashes(req)

    def _allocate_or_preempt(self, req: Request, num_new_tokens: int) -> None:
        before = self._snapshot()
        start = req.num_computed_tokens
        if self.mgr.allocate_slots(req, num_new_tokens) is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            event("preempt")
            self._record_hashes(req)
            self.mgr.free(req)
            req.num_computed_tokens = 0
            self.waiting[req.request_id] = self.running.pop(req.request_id)
            return
        self._forward(req, start, start + num_new_tokens)

    def _pick(self, data: st.DataObject, reqs: dict[str, Request]) -> Request:
        return reqs[data.draw(st.sampled_from(sorted(reqs)))]

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        prompt=PROMPTS,
        salt=st.sampled_from([None, None, "s"]),
    )
    def add(self, prompt: list[int], salt: str | None) -> None:
        req = self._new_request(prompt, salt)
        self.waiting[req.request_id] = req

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data: st.DataObject) -> None:
        req = self._pick(data, self.waiting)
        hit, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit == len(hit) * BS < req.num_tokens
        for i, block in enumerate(hit):
            assert block.block_id != 0
            assert self.slots[block.block_id] == req.all_token_ids[i * BS : (i + 1) * BS], "stale hit"
        if hit:
            event("prefix hit" + (" on a free block" if any(b.ref_cnt == 0 for b in hit) else ""))
        num_new = data.draw(st.integers(1, req.num_tokens - num_hit), label="chunk")
        before = self._snapshot()
        if self.mgr.allocate_slots(req, num_new, hit) is None:
            assert self._snapshot() == before, "a failed allocation changed state"
            event("waiting request does not fit" + (" (with a hit)" if hit else ""))
            return
        self.running[req.request_id] = self.waiting.pop(req.request_id)
        req.num_computed_tokens = num_hit
        self._forward(req, num_hit, num_hit + num_new)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.running.values()))
    @rule(data=st.data())
    def continue_prefill(self, data: st.DataObject) -> None:
        partial = {k: r for k, r in self.running.items() if r.num_computed_tokens < r.num_tokens}
        req = self._pick(data, partial)
        num_new = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens), label="chunk")
        self._allocate_or_preempt(req, num_new)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.running.values()))
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        done = {k: r for k, r in self.running.items() if r.num_computed_tokens == r.num_tokens}
        req = self._pick(data, done)
        req.append_output_token(token)
        self._allocate_or_preempt(req, 1)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data, self.running)
        child = self._new_request(parent.prompt_token_ids, parent.cache_salt)
        for t in parent.output_token_ids:
            child.append_output_token(t)
        child.num_computed_tokens = parent.num_computed_tokens
        self.mgr.fork(parent, child)
        assert self.mgr.get_block_ids(child.request_id) == self.mgr.get_block_ids(parent.request_id)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        req = self._pick(data, {**self.waiting, **self.running})
        self._record_hashes(req)
        self.mgr.free(req)
        self.waiting.pop(req.request_id, None)
        self.running.pop(req.request_id, None)
        assert self.mgr.num_blocks_of(req.request_id) == 0

    @rule()
    def reset_prefix_cache(self) -> None:
        all_free = not self.running
        assert self.mgr.reset_prefix_cache() is all_free
        if all_free:
            assert self.mgr.block_pool.cached_blocks == {}

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        pool = self.mgr.block_pool
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        free_set = set(free_ids)
        assert len(free_ids) == len(free_set) == pool.num_free_blocks
        holders = Counter(bid for rid in self.running for bid in self.mgr.get_block_ids(rid))
        assert 0 not in holders and 0 not in free_set, "null block handed out or freed"
        assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None
        for block in pool.blocks[1:]:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id], block
            assert (block.ref_cnt == 0) == (block.block_id in free_set), block
        assert pool.num_free_blocks + len(holders) == pool.num_total_usable
        assert self.mgr.allocated_slots() == len(holders) * BS

    @invariant()
    def requests_hold_exactly_their_computed_tokens(self) -> None:
        for rid in self.waiting:
            assert self.mgr.num_blocks_of(rid) == 0
        for rid, req in self.running.items():
            block_ids = self.mgr.get_block_ids(rid)
            assert len(block_ids) == _cdiv(req.num_computed_tokens, BS) == self.mgr.num_blocks_of(rid)
            for pos in range(req.num_computed_tokens):
                assert self.slots[block_ids[pos // BS]][pos % BS] == req.all_token_ids[pos], (rid, pos)

    @invariant()
    def cached_blocks_hold_their_hash_content(self) -> None:
        pool = self.mgr.block_pool
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
            assert self.slots[block.block_id] == self.hash_tokens[block_hash]
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_blocks)

    def teardown(self) -> None:
        for req in [*self.running.values(), *self.waiting.values()]:
            self.mgr.free(req)
        pool = self.mgr.block_pool
        assert pool.num_free_blocks == pool.num_total_usable
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert self.mgr.take_pending_copies() == []


AllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorProperties = AllocatorMachine.TestCase
