"""The step-input builder (numpy on persistent buffers) and the CUDA-graph size buckets."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from paged_backend.worker.cuda_graphs import DecodeGraphs, capture_sizes
from paged_backend.worker.step_inputs import StepInputBuilder


@dataclass
class _Params:
    prompt_logprobs: int | None = None


@dataclass
class _Req:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: _Params = field(default_factory=_Params)


@dataclass
class _Sched:
    request: _Req
    start_pos: int
    num_new_tokens: int
    block_ids: list[int]
    num_draft: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_logits(self) -> int:
        r = self.request
        return r.num_prompt_tokens - 1 if r.sampling_params.prompt_logprobs is not None else 0

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start_pos : self.start_pos + self.num_new_tokens]

    @property
    def samples(self) -> bool:
        return self.start_pos + self.num_new_tokens == len(self.request.all_token_ids)


@dataclass
class _Out:
    scheduled: list[_Sched]


def _builder(max_tokens: int = 64, max_seqs: int = 8, max_blocks: int = 6) -> StepInputBuilder:
    return StepInputBuilder(max_tokens, max_seqs, max_blocks, block_size=4, device=torch.device("cpu"))


def test_mixed_batch_matches_the_index_contract():
    a = _Req("a", list(range(100, 110)), num_prompt_tokens=10)  # prefill chunk: positions 3..9
    b = _Req("b", list(range(200, 206)), num_prompt_tokens=5)  # decode: position 5
    c = _Req("c", list(range(300, 320)), num_prompt_tokens=20, sampling_params=_Params(prompt_logprobs=1))
    sched = _Out([_Sched(a, 3, 7, [7, 3, 9]), _Sched(b, 5, 1, [4, 8]), _Sched(c, 0, 6, [11, 12])])
    step = _builder().build(sched)
    assert step.input_ids.tolist() == list(range(103, 110)) + [205] + list(range(300, 306))
    assert step.positions.tolist() == list(range(3, 10)) + [5] + list(range(0, 6))
    blocks = {0: [7, 3, 9], 1: [4, 8], 2: [11, 12]}
    owner = [0] * 7 + [1] + [2] * 6
    expect = [blocks[o][p // 4] * 4 + p % 4 for o, p in zip(owner, step.positions.tolist(), strict=True)]
    assert step.meta.slot_mapping.tolist() == expect
    assert step.meta.seq_lens.tolist() == [10, 6, 6]
    assert step.meta.query_start_loc.tolist() == [0, 7, 8, 14]
    assert step.meta.block_tables[0].tolist() == [7, 3, 9]
    assert step.meta.block_tables[1, :2].tolist() == [4, 8]
    assert (step.meta.max_query_len, step.meta.max_seq_len) == (7, 10)
    assert step.meta.seq_lens_cpu == [10, 6, 6] and step.meta.query_lens_cpu == [7, 1, 6]
    assert not step.decode_only
    # a and b reach their last token and sample; c is mid-prompt but wants prompt logprobs
    assert step.sample_request_ids == ["a", "b"] and step.sample_rows == [6, 7]
    assert step.prompt_spans == [("c", 8, 6, 0)]


def test_draft_tokens_get_a_logits_row_each():
    # b: last token at position 5 plus drafts 206, 207 (positions 6, 7); a and c decode one token
    a = _Req("a", [1, 2, 3, 4], num_prompt_tokens=3)
    b = _Req("b", list(range(200, 208)), num_prompt_tokens=5)
    c = _Req("c", [9, 9, 9], num_prompt_tokens=2)
    sched = _Out([_Sched(a, 3, 1, [4]), _Sched(b, 5, 3, [5, 6], num_draft=2), _Sched(c, 2, 1, [7])])
    step = _builder().build(sched)
    assert step.input_ids.tolist() == [4, 205, 206, 207, 9]
    assert step.positions.tolist() == [3, 5, 6, 7, 2]
    assert step.meta.slot_mapping.tolist() == [4 * 4 + 3, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 7 * 4 + 2]
    assert not step.decode_only and step.meta.query_lens_cpu == [1, 3, 1]
    assert step.sample_request_ids == ["a", "b", "b", "b", "c"] and step.sample_rows == [0, 1, 2, 3, 4]


def test_decode_batch_pads_to_a_graph_size():
    reqs = [_Req(str(i), [1] * (5 + i), num_prompt_tokens=3) for i in range(3)]
    sched = _Out([_Sched(r, len(r.all_token_ids) - 1, 1, [10 + i, 20 + i]) for i, r in enumerate(reqs)])
    b = _builder()
    b.build(_Out([_Sched(_Req("x", [5] * 24, 24), 0, 24, [1, 2, 3, 4, 5, 6])]))  # leaves stale rows behind
    step = b.build(sched, pad_to=8, max_seq_len_bound=24)
    assert step.decode_only and step.num_seqs == 3 and step.num_tokens == 3
    assert step.input_ids.shape[0] == 8 and step.meta.block_tables.shape == (8, 6)
    assert step.meta.slot_mapping[3:].tolist() == [-1] * 5  # padding writes nothing
    assert step.meta.seq_lens[3:].tolist() == [1] * 5
    assert step.meta.query_start_loc.tolist() == list(range(9))
    assert step.meta.block_tables[3:, 0].tolist() == [0] * 5  # padding reads the null block
    assert step.meta.max_seq_len == 24  # the bound the graph was captured with
    assert step.positions[:3].tolist() == [4, 5, 6]
    assert step.meta.slot_mapping[:3].tolist() == [20 * 4 + 0, 21 * 4 + 1, 22 * 4 + 2]  # second block of each


def test_fits_reports_overflow():
    b = _builder(max_tokens=16, max_seqs=2, max_blocks=3)
    assert b.fits(16, 2, 3)
    assert not b.fits(17, 2, 3) and not b.fits(4, 3, 1) and not b.fits(4, 1, 4)


@pytest.mark.parametrize("cap, expect_tail", [(1, [1]), (6, [1, 2, 4, 6]), (20, [8, 16, 20]), (256, [248, 256]),
                                              (300, [288, 300]), (512, [496, 512]), (1024, [992, 1024])])
def test_capture_sizes(cap, expect_tail):
    sizes = capture_sizes(cap)
    assert sizes == sorted(set(sizes)) and sizes[-1] == cap
    assert sizes[-len(expect_tail):] == expect_tail


def test_capture_sizes_reach_1024_with_as_many_graphs_as_vllms_512():
    sizes = capture_sizes(1024)
    assert len(sizes) == 67 and {256, 272, 512, 544} <= set(sizes)
    assert all(b - a == 32 for a, b in zip(sizes[sizes.index(512):], sizes[sizes.index(512) + 1:], strict=False))


def test_bucket_is_the_smallest_size_that_fits():
    g = DecodeGraphs(lambda *a: None, _builder(), max_size=40, max_model_len=64)
    assert [g.bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 40)] == [1, 2, 4, 8, 8, 16, 40, 40]
    assert g.bucket(41) is None


def _pending_request(rid: str, tokens: list[int]):
    """A real request whose next token is still on the device (async scheduling)."""
    from paged_backend.core.request import Request
    from paged_backend.sampling_params import SamplingParams

    req = Request(rid, tokens, SamplingParams(max_tokens=8), max_tokens=8)
    req.num_computed_tokens = len(tokens)
    req.num_pending = 1
    return req


@pytest.mark.parametrize("mixed", [False, True])
def test_placeholder_tokens_come_from_the_previous_steps_sampled_ids(mixed):
    from paged_backend.core.scheduler import ScheduledRequest

    a = _pending_request("a", [1, 2, 3, 4, 5])
    c = _pending_request("c", [9, 8, 7])
    sched = [ScheduledRequest(a, 5, 1, [3, 4])]
    if mixed:  # a prompt chunk between the two decodes: placeholders found by row owner
        b = _Req("b", list(range(200, 206)), num_prompt_tokens=6)
        sched.append(_Sched(b, 0, 3, [5]))
    sched.append(ScheduledRequest(c, 3, 1, [6]))
    assert [s.token_ids for s in sched if isinstance(s, ScheduledRequest)] == [[-1], [-1]]
    assert all(s.samples for s in sched if isinstance(s, ScheduledRequest))
    prev = (["c", "x", "a"], torch.tensor([70, 71, 72]))
    builder = _builder()
    step = builder.build(_Out(sched), pad_to=None if mixed else 8, prev=prev)
    expect = [72] + ([200, 201, 202] if mixed else []) + [70]
    assert step.input_ids[: len(expect)].tolist() == expect
    assert step.positions[: len(expect)].tolist() == [5] + ([0, 1, 2] if mixed else []) + [3]
    with pytest.raises(RuntimeError, match="in flight"):
        builder.build(_Out(sched))


def test_block_table_rows_follow_their_requests_across_steps():
    """Rows are rewritten only when the row's block list object changes (the KV manager never
    edits a stored list in place): reuse, reordering, a new list for a request, padding."""
    b = _builder()
    la, lb, lc = [1, 2], [3, 8], [4, 5, 6]
    ra, rb, rc = (_Req(n, [9] * 6, 3) for n in "abc")

    def step(*rows: tuple[_Req, list[int]], pad_to: int | None = None):
        out = b.build(_Out([_Sched(r, 5, 1, blocks) for r, blocks in rows]), pad_to=pad_to)
        n = len(rows)
        for i, (_, blocks) in enumerate(rows):  # the kernel reads columns < len(blocks)
            assert out.meta.block_tables[i, : len(blocks)].tolist() == blocks
        assert out.meta.slot_mapping[:n].tolist() == [blocks[5 // 4] * 4 + 1 for _, blocks in rows]
        return out

    step((ra, la), (rb, lb), (rc, lc))
    step((ra, la), (rb, lb), (rc, lc))  # same lists: nothing rewritten, still right
    step((rc, lc), (ra, la))  # reordered and one gone
    la2 = [1, 7]  # a's blocks changed (e.g. copy-on-write): a new list of the same length
    step((rc, lc), (ra, la2))
    step((ra, la2), (rb, lb), pad_to=4)  # padding rows 2-3 take the null block ...
    step((ra, la2), (rb, lb), (rc, lc), (ra, la2))  # ... and are rewritten when used again
    assert b.table_np[3, :2].tolist() == la2


def _verification(builder_blocks: int = 3):
    """Three requests past their prompts, each with its last token and 2 drafts (3 new tokens a request)."""
    reqs = [_Req(str(i), [7 + i] * (6 + i) + [1, 2], num_prompt_tokens=4) for i in range(3)]
    return _Out([_Sched(r, len(r.all_token_ids) - 3, 3, [10 + i, 20 + i, 30 + i][:builder_blocks], num_draft=2)
                 for i, r in enumerate(reqs)])


def test_uniform_multi_token_batch_pads_to_a_graph_size_with_the_eager_metadata():
    sched = _verification()
    eager = _builder().build(sched)
    b = _builder()
    b.build(_Out([_Sched(_Req("x", [5] * 24, 24), 0, 24, [1, 2, 3, 4, 5, 6])]))  # leaves stale rows behind
    step = b.build(sched, pad_to=8, max_seq_len_bound=24)
    q, n = 3, 9
    assert step.num_seqs == 3 and step.num_tokens == n and not step.decode_only
    assert step.input_ids.shape[0] == 8 * q and step.meta.slot_mapping.shape[0] == 8 * q
    assert step.meta.block_tables.shape == (8, 6)
    # the real rows: what the eager build gives
    assert step.meta.slot_mapping[:n].tolist() == eager.meta.slot_mapping.tolist()
    assert step.input_ids[:n].tolist() == eager.input_ids.tolist()
    assert step.positions[:n].tolist() == eager.positions.tolist()
    assert step.meta.seq_lens[:3].tolist() == eager.meta.seq_lens.tolist()
    assert step.meta.query_start_loc[:4].tolist() == eager.meta.query_start_loc.tolist() == [0, 3, 6, 9]
    assert step.meta.block_tables[:3, :3].tolist() == eager.meta.block_tables.tolist()
    assert step.meta.max_query_len == eager.meta.max_query_len == q
    assert step.meta.max_seq_len == 24  # the bound the graph was captured with
    assert (step.sample_rows, step.sample_request_ids) == (eager.sample_rows, eager.sample_request_ids)
    assert step.sample_rows == list(range(n))  # every row sampled: the runner slices, no gather
    # the padding rows: q tokens at positions 0..q-1, writing nothing, reading the null block
    assert step.meta.slot_mapping[n:].tolist() == [-1] * (5 * q)
    assert step.positions[n:].tolist() == [0, 1, 2] * 5
    assert step.input_ids[n:].tolist() == [0] * (5 * q)
    assert step.meta.seq_lens[3:].tolist() == [q] * 5
    assert step.meta.query_start_loc.tolist() == list(range(0, 8 * q + 1, q))
    assert step.meta.block_tables[3:, 0].tolist() == [0] * 5


def test_padding_rows_longer_than_a_block_read_only_null_blocks():
    """q = 6 tokens over blocks of 4: the padding rows' first two table columns are the null block."""
    reqs = [_Req("a", [3] * 10, num_prompt_tokens=5)]
    sched = _Out([_Sched(reqs[0], 4, 6, [11, 12, 13], num_draft=5)])
    b = _builder()
    b.build(_Out([_Sched(_Req("x", [5] * 24, 24), 0, 24, [1, 2, 3, 4, 5, 6]),
                  _Sched(_Req("y", [5] * 24, 24), 0, 24, [7, 8, 9, 10, 11, 12])]))
    step = b.build(sched, pad_to=2, max_seq_len_bound=24)
    assert step.meta.block_tables[1, :2].tolist() == [0, 0]
    assert step.meta.seq_lens.tolist() == [10, 6] and step.meta.query_start_loc.tolist() == [0, 6, 12]
    assert step.positions[6:].tolist() == list(range(6)) and step.meta.slot_mapping[6:].tolist() == [-1] * 6


def test_padding_refuses_a_batch_of_mixed_query_lengths_unless_told_the_rows_per_request():
    reqs = [_Req(str(i), [1] * 8, num_prompt_tokens=4) for i in range(2)]
    sched = _Out([_Sched(reqs[0], 5, 3, [1, 2], num_draft=2), _Sched(reqs[1], 7, 1, [3, 4])])
    with pytest.raises(ValueError, match="at most that many new tokens"):
        _builder().build(sched, pad_to=4, max_seq_len_bound=24)
    with pytest.raises(ValueError, match="at most that many new tokens"):
        _builder().build(sched, pad_to=4, max_seq_len_bound=24, pad_query_len=2)  # a request has 3


def test_a_verification_with_fewer_drafts_spreads_each_request_over_q_rows():
    """Requests with 2, 0 and 1 drafts in the graph of 3 tokens a request: each request's tokens start at row
    3 i with their eager positions and slots, filler rows after them write nothing, the row index maps the
    eager rows to them, and the logits rows stay the eager build's (they index the gathered rows)."""
    reqs = [_Req("a", [7] * 6 + [1, 2], 4), _Req("b", [8] * 9, 4), _Req("c", [9] * 5 + [3], 4)]
    sched = _Out([_Sched(reqs[0], 5, 3, [10, 20], num_draft=2), _Sched(reqs[1], 8, 1, [11, 21, 31]),
                  _Sched(reqs[2], 4, 2, [12, 22], num_draft=1)])
    eager = _builder().build(sched)
    b = _builder()
    b.build(_Out([_Sched(_Req("x", [5] * 24, 24), 0, 24, [1, 2, 3, 4, 5, 6])]))  # leaves stale rows behind
    step = b.build(sched, pad_to=4, max_seq_len_bound=24, pad_query_len=3)
    n = 6
    assert step.num_tokens == n and step.input_ids.shape[0] == 12 and step.meta.max_query_len == 3
    rows = step.row_index.tolist()
    assert rows == [0, 1, 2, 3, 6, 7]
    assert step.input_ids[rows].tolist() == eager.input_ids.tolist()
    assert step.positions[rows].tolist() == eager.positions.tolist()
    assert step.meta.slot_mapping[rows].tolist() == eager.meta.slot_mapping.tolist()
    fillers = [4, 5, 8, 9, 10, 11]
    assert step.meta.slot_mapping[fillers].tolist() == [-1] * 6
    assert step.positions[[4, 5, 8]].tolist() == [8, 8, 5]  # a filler sits at its request's last position
    # each request's q rows end where its rows + fillers end: the real rows keep their positions
    assert step.meta.seq_lens.tolist() == [5 + 3, 8 + 3, 4 + 3, 3]
    assert step.meta.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    for i, s in enumerate(sched.scheduled):  # each request's blocks (columns past them are never read as its KV)
        assert step.meta.block_tables[i, :len(s.block_ids)].tolist() == s.block_ids
    assert (step.sample_rows, step.sample_request_ids) == (eager.sample_rows, eager.sample_request_ids)
    # a uniform step has no row index
    assert b.build(_verification(), pad_to=4, max_seq_len_bound=24, pad_query_len=3).row_index is None


def test_multi_token_buckets_fit_the_step_buffers():
    g = DecodeGraphs(lambda *a: None, _builder(max_tokens=64), max_size=40, max_model_len=64, query_lens=(1, 5))
    assert g.sizes_by_q[5] == [1, 2, 4, 8, 12]  # 12 rows of 5 tokens fill 60 of the 64 token slots
    assert [g.bucket(n, 5) for n in (1, 3, 9, 12)] == [1, 4, 12, 12]
    assert g.bucket(13, 5) is None and g.bucket(2, 3) is None  # too many rows; a length not captured
    assert g.bucket(33) == 40  # decode steps keep their sizes


def test_placeholder_tokens_of_a_padded_multi_token_step():
    """A draft model's lookahead pass reads the previous pass's tokens on the device (placeholders) in a
    padded graph batch: the real rows get them, the padding rows stay token 0."""
    from paged_backend.core.scheduler import ScheduledRequest

    b = _builder()
    sched = _Out([ScheduledRequest.lookahead("a", 5, -1, [3, 4]), ScheduledRequest.lookahead("c", 2, -1, [7])])
    prev = (["c", "a"], torch.tensor([31, 11]))
    step = b.build(sched, pad_to=4, max_seq_len_bound=24, prev=prev)
    assert step.input_ids.tolist() == [11, 31, 0, 0]
    assert step.meta.slot_mapping.tolist() == [4 * 4 + 1, 7 * 4 + 2, -1, -1]
