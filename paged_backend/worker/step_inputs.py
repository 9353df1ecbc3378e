"""Builds one step's model inputs from a SchedulerOutput, with numpy on persistent buffers.

Host arrays live in (pinned, on CUDA) tensors allocated once; each step fills them with a
short Python loop over the scheduled requests plus vectorized numpy, then copies the used
prefix to device buffers that are also allocated once (non-blocking on CUDA). The device
buffers never move, so a CUDA graph captured over slices of them replays with the next
step's inputs (see ``cuda_graphs.py``). Rows past the step's requests are padding: as many
tokens as each real row has (1 in a decode step), at positions 0.. in no slot (``slot_mapping``
-1), reading the null block 0.

Async scheduling: a token sampled by the step still in flight is -1 in the scheduled token
ids; ``build`` copies it on the device from that step's sampled ids (``prev``), so the
host never waits for it. The host buffers are rewritten only after the previous upload
has left them (an event recorded after each upload).

Index math (docs/ARCHITECTURE.md's contract)::

    query_start_loc = [0, q0, q0+q1, ...]            seq_lens[i] = start_i + q_i
    positions[t]    = start_i + (t - query_start_loc[i])   for t in request i's rows
    slot_mapping[t] = block_tables[i, pos // bs] * bs + pos % bs
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from paged_backend.attention.backend import AttentionMetadata
from paged_backend.core.scheduler import ScheduledRequest, SchedulerOutput


class PendingTokens:
    """The sampled ids of the step before, queued on the device only when first asked for (``get``): the
    engine defers that step's sampling while its structured-output masks are being filled, and the runner
    asks after this step's inputs are built and uploaded, before its forward pass (which reads them)."""

    def __init__(self, launch: Callable[[], torch.Tensor]) -> None:
        self._launch: Callable[[], torch.Tensor] | None = launch
        self._tokens: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._launch is not None:
            with torch.inference_mode(False):  # the engine's sampling, as outside the runner's forward
                self._tokens, self._launch = self._launch(), None
        assert self._tokens is not None
        return self._tokens


def sampled_tokens(prev: tuple[list[str], torch.Tensor | PendingTokens]) -> torch.Tensor:
    """``prev``'s sampled ids on the device (queued now if they were pending)."""
    tokens = prev[1]
    return tokens.get() if isinstance(tokens, PendingTokens) else tokens


@dataclass
class StepInputs:
    """What one forward pass reads, plus where the logits rows come from."""

    input_ids: torch.Tensor  # int64 [T] (padded: [num_padded_tokens])
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    num_tokens: int  # real tokens (T before padding)
    num_seqs: int  # real requests
    decode_only: bool  # every request has exactly one new token
    sample_request_ids: list[str]  # one per sampled row: a request with k drafts has k + 1 in a row
    sample_rows: list[int]  # hidden-state rows whose logits are sampled
    prompt_spans: list[tuple[str, int, int, int]]  # (request id, first row, count, start position)
    # a padded step whose requests have fewer new tokens than its rows (``build``'s ``pad_query_len``): the row
    # of each real token (device int64 [num_tokens]); the rows above (sample_rows, prompt_spans) count real
    # tokens only, so the forward's output is gathered by it first. None: the real tokens are rows 0..T-1.
    row_index: torch.Tensor | None = None


@dataclass
class _Rows:
    """The per-request lists one step's rows were filled from."""

    num_seqs: int
    num_tokens: int
    starts: list[int]
    qlens: list[int]
    max_blocks: int
    sample_ids: list[str]
    sample_rows: list[int]
    prompt_spans: list[tuple[str, int, int, int]]


class StepInputBuilder:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self._h_ids = host((max_tokens,), torch.int64)
        self._h_pos = host((max_tokens,), torch.int64)
        self._h_slots = host((max_tokens,), torch.int64)
        self._h_seq_lens = host((max_seqs,), torch.int32)
        self._h_qsl = host((max_seqs + 1,), torch.int32)
        self._h_table = host((max_seqs, max_blocks_per_seq), torch.int32)
        self.ids_np, self.pos_np, self.slots_np = self._h_ids.numpy(), self._h_pos.numpy(), self._h_slots.numpy()
        self.seq_lens_np, self.qsl_np, self.table_np = (
            self._h_seq_lens.numpy(), self._h_qsl.numpy(), self._h_table.numpy())
        # the block-id list whose ids each host table row holds (None: unknown). The KV manager
        # never changes a request's list in place (a new list whenever its blocks change), so a
        # row whose request brings the same list object again is up to date: decode steps
        # rewrite only rows whose blocks changed (a new block, COW, a new request in the row)
        self._row_blocks: list[list[int] | None] = [None] * max_seqs
        self._h_ph_rows = host((max_tokens,), torch.int64)  # placeholder rows and their source rows
        self._h_ph_src = host((max_tokens,), torch.int64)
        self._h_row_index = host((max_tokens,), torch.int64)  # a spread step's row of each real token
        self._uploaded: torch.cuda.Event | None = None
        if pin:
            self._row_index = torch.zeros_like(self._h_row_index, device=device)
            self._ph_rows = torch.zeros_like(self._h_ph_rows, device=device)
            self._ph_src = torch.zeros_like(self._h_ph_src, device=device)
            self.ids, self.pos, self.slots, self.seq_lens, self.qsl, self.table = (
                torch.zeros_like(t, device=device) for t in
                (self._h_ids, self._h_pos, self._h_slots, self._h_seq_lens, self._h_qsl, self._h_table))
        else:  # the CPU reads the host arrays themselves
            self._row_index = self._h_row_index
            self._ph_rows, self._ph_src = self._h_ph_rows, self._h_ph_src
            self.ids, self.pos, self.slots = self._h_ids, self._h_pos, self._h_slots
            self.seq_lens, self.qsl, self.table = self._h_seq_lens, self._h_qsl, self._h_table

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and max_blocks <= self.max_blocks

    def build(self, sched: SchedulerOutput, pad_to: int | None = None, max_seq_len_bound: int | None = None,
              sliding_window: int | None = None,
              prev: tuple[list[str], torch.Tensor | PendingTokens] | None = None, pad_query_len: int | None = None) -> StepInputs:
        """Fills the buffers; ``pad_to`` rounds a uniform batch (every request has the same number ``q`` of new
        tokens: 1 in a decode step, 1 + k in a verification of k drafts) up to a captured graph's size, with
        padding rows of ``q`` tokens. ``pad_query_len`` names ``q`` (needed where no request has that many: a
        batch of padding rows only, or a step whose requests have at most ``q`` new tokens but not all ``q``,
        each then spread over ``q`` rows, ``_spread_rows``, and ``StepInputs.row_index`` set).

        ``prev``: the step in flight's sampled request ids and sampled token ids (device int64,
        same order; or ``PendingTokens``, asked for after the upload), for the placeholder (-1) tokens of this step.
        """
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has read the pinned buffers
        rows = self._fill_rows(sched.scheduled)
        s_count, num_tokens, qlens = rows.num_seqs, rows.num_tokens, rows.qlens
        decode_only = num_tokens == s_count
        seq_lens_cpu = self._fill_positions(rows, decode_only)
        ph_rows = self._stage_placeholders(sched.scheduled, rows, decode_only, prev)

        n_seqs, n_tok, max_blocks = s_count, num_tokens, rows.max_blocks
        max_query_len = max(qlens, default=1)
        row_index = None
        if pad_to is not None:
            q = pad_query_len if pad_query_len is not None else (qlens[0] if qlens else 1)
            ragged = qlens.count(q) != s_count
            if pad_to < s_count or max_query_len > q or (ragged and pad_query_len is None):
                raise ValueError(f"padding to {pad_to} rows of {q} tokens needs at most that many requests of at most "
                                 f"that many new tokens, the same for all unless pad_query_len is given (got {qlens})")
            max_query_len = q
            if ragged:
                ph_rows, row_index = self._spread_rows(rows, q, ph_rows)
            n_seqs, n_tok = pad_to, pad_to * q
            max_blocks = max(max_blocks, -(-q // self.block_size))
            if pad_to > s_count:
                self._pad(s_count, pad_to, q)
        self._upload(n_tok, n_seqs, max_blocks)
        # pending ids are asked for here, after the upload, also without placeholders: the step before is
        # sampled before this step's forward either way
        tokens = sampled_tokens(prev) if prev is not None else None
        n_ph = len(ph_rows)
        if n_ph:
            assert tokens is not None
            src = self._ph_src[:n_ph]
            if self._ph_src is not self._h_ph_src:
                src.copy_(self._h_ph_src[:n_ph], non_blocking=True)
                self._ph_rows[:n_ph].copy_(self._h_ph_rows[:n_ph], non_blocking=True)
            self.ids.index_copy_(0, self._ph_rows[:n_ph], tokens.index_select(0, src))
        if row_index is not None and self._row_index is not self._h_row_index:
            row_index.copy_(self._h_row_index[:num_tokens], non_blocking=True)
        if self.device.type == "cuda":
            if self._uploaded is None:
                self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        dev_table = self.table[:n_seqs] if pad_to is not None else self.table[:n_seqs, :rows.max_blocks]
        meta = AttentionMetadata(
            slot_mapping=self.slots[:n_tok],
            block_tables=dev_table,
            seq_lens=self.seq_lens[:n_seqs],
            query_start_loc=self.qsl[: n_seqs + 1],
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens_cpu, default=1) if max_seq_len_bound is None else max_seq_len_bound,
            block_size=self.block_size,
            seq_lens_cpu=seq_lens_cpu,
            query_lens_cpu=qlens,
            sliding_window=sliding_window,
        )
        return StepInputs(self.ids[:n_tok], self.pos[:n_tok], meta, num_tokens, s_count, decode_only,
                          rows.sample_ids, rows.sample_rows, rows.prompt_spans, row_index)

    def _fill_rows(self, scheduled: list[ScheduledRequest]) -> _Rows:
        """Token ids and block-table rows; the per-request lists the other steps vectorize."""
        s_count = len(scheduled)
        toks: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        nbs: list[int] = []
        flat_blocks: list[int] = []  # of the rows to rewrite
        dirty_rows: list[int] = []
        row_blocks = self._row_blocks
        sample_ids: list[str] = []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[str, int, int, int]] = []
        t = 0
        for row, s in enumerate(scheduled):  # one pass of list appends; numpy takes the lists in one go each
            n = s.num_new_tokens
            start = s.start_pos
            toks += s.token_ids
            starts.append(start)
            qlens.append(n)
            blocks = s.block_ids
            nbs.append(len(blocks))
            if row_blocks[row] is not blocks:
                row_blocks[row] = blocks
                dirty_rows.append(row)
                flat_blocks += blocks
            if s.num_prompt_logits:
                count = min(start + n, s.num_prompt_logits) - start
                if count > 0:
                    prompt_spans.append((s.request_id, t, count, start))
            t += n
            if s.samples:
                k = s.num_draft
                if k:  # speculative decoding: the rows of the last known token and of each draft
                    sample_ids += [s.request_id] * (k + 1)
                    sample_rows += range(t - 1 - k, t)
                else:
                    sample_ids.append(s.request_id)
                    sample_rows.append(t - 1)
        self.ids_np[:t] = toks
        nb = np.asarray(nbs, dtype=np.int64)
        if dirty_rows:  # block ids into their rows: row r gets columns 0..nb[r]-1
            dirty = np.asarray(dirty_rows, dtype=np.int64)
            dnb = nb[dirty]
            rows_of = np.repeat(dirty, dnb)
            col_of = np.arange(len(flat_blocks)) - np.repeat(np.cumsum(dnb) - dnb, dnb)
            self.table_np[rows_of, col_of] = flat_blocks
        return _Rows(s_count, t, starts, qlens, int(nb.max()) if s_count else 1, sample_ids, sample_rows,
                     prompt_spans)

    def _fill_positions(self, rows: _Rows, decode_only: bool) -> list[int]:
        """seq_lens, query_start_loc, positions and slots; returns seq_lens as a list."""
        s_count, num_tokens = rows.num_seqs, rows.num_tokens
        st = np.asarray(rows.starts, dtype=np.int64)
        ql = np.asarray(rows.qlens, dtype=np.int64)
        seq_lens = self.seq_lens_np
        seq_lens[:s_count] = st + ql
        qsl = self.qsl_np
        qsl[0] = 0
        qsl[1 : s_count + 1] = np.cumsum(ql)
        bs = self.block_size
        pos = self.pos_np
        if decode_only:
            pos[:num_tokens] = st
            seq_idx = np.arange(s_count)
        else:
            seq_idx = np.repeat(np.arange(s_count), ql)
            pos[:num_tokens] = np.arange(num_tokens) + np.repeat(st - qsl[:s_count], ql)
        p = pos[:num_tokens]
        self.slots_np[:num_tokens] = self.table_np[seq_idx, p // bs].astype(np.int64) * bs + p % bs
        return seq_lens[:s_count].tolist()

    def _stage_placeholders(self, scheduled: list[ScheduledRequest], rows: _Rows, decode_only: bool,
                            prev: tuple[list[str], torch.Tensor | PendingTokens] | None) -> np.ndarray:
        """The rows whose token is still in flight (-1), and where in ``prev`` each one's token is."""
        ids = self.ids_np
        ph_rows = np.flatnonzero(ids[: rows.num_tokens] < 0)
        if len(ph_rows):
            if prev is None:
                raise RuntimeError("a scheduled token is still in flight but no previous step was given")
            index = {rid: i for i, rid in enumerate(prev[0])}
            s_count = rows.num_seqs
            owners = ph_rows if decode_only else np.searchsorted(self.qsl_np[1 : s_count + 1], ph_rows, side="right")
            self._h_ph_src[: len(ph_rows)] = torch.from_numpy(
                np.fromiter((index[scheduled[i].request_id] for i in owners.tolist()), np.int64, len(ph_rows)))
            self._h_ph_rows[: len(ph_rows)] = torch.from_numpy(ph_rows)
            ids[ph_rows] = 0  # until the device copy in build (the CPU reads these very arrays)
        return ph_rows

    def _spread_rows(self, rows: _Rows, q: int, ph_rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """Request i's tokens moved to rows i*q.., each followed by q - q_i filler rows (token 0 at its last
        position, in no slot): every request then has q rows, as the graph captured for q tokens a request
        reads them. Its real tokens keep their positions (``seq_lens`` = start + q: the kernel places the q
        rows at start..start+q-1 and masks causally, so the real ones never see the fillers, which attend to
        whatever the null or stale table entries name and are dropped). Returns the placeholder rows moved
        and the device view the real tokens' rows are uploaded to."""
        s_count, num_tokens = rows.num_seqs, rows.num_tokens
        st = np.asarray(rows.starts, dtype=np.int64)
        ql = np.asarray(rows.qlens, dtype=np.int64)
        qsl = self.qsl_np
        dest = np.arange(num_tokens) + np.repeat(np.arange(s_count) * q - qsl[:s_count], ql)
        n = s_count * q
        for buf, fill in ((self.ids_np, 0), (self.slots_np, -1)):
            real = buf[:num_tokens].copy()
            buf[:n] = fill
            buf[dest] = real
        real = self.pos_np[:num_tokens].copy()
        self.pos_np[:n] = np.repeat(st + ql - 1, q)
        self.pos_np[dest] = real
        self.seq_lens_np[:s_count] = st + q
        qsl[: s_count + 1] = np.arange(0, n + 1, q)
        self._h_row_index[:num_tokens] = torch.from_numpy(dest)
        ph_rows = dest[ph_rows]
        self._h_ph_rows[: len(ph_rows)] = torch.from_numpy(ph_rows)
        return ph_rows, self._row_index[:num_tokens]

    def _pad(self, s_count: int, pad_to: int, q: int = 1) -> None:
        """Rows s_count..pad_to-1: ``q`` tokens at positions 0..q-1 each, in no slot, reading the null block."""
        n_pad = pad_to - s_count
        t0 = s_count * q
        t1 = t0 + n_pad * q
        self.ids_np[t0:t1] = 0
        self.pos_np[t0:t1] = np.tile(np.arange(q), n_pad) if q > 1 else 0
        self.slots_np[t0:t1] = -1
        self.seq_lens_np[s_count:pad_to] = q
        self.qsl_np[s_count + 1 : pad_to + 1] = np.arange(t0 + q, t1 + 1, q)
        self.table_np[s_count:pad_to, : -(-q // self.block_size)] = 0
        self._row_blocks[s_count:pad_to] = [None] * n_pad

    def _upload(self, n_tok: int, n_seqs: int, max_blocks: int) -> None:
        if self.ids is self._h_ids:
            return
        nb = True  # pinned host buffers; the next build waits for this upload before rewriting them
        self.ids[:n_tok].copy_(self._h_ids[:n_tok], non_blocking=nb)
        self.pos[:n_tok].copy_(self._h_pos[:n_tok], non_blocking=nb)
        self.slots[:n_tok].copy_(self._h_slots[:n_tok], non_blocking=nb)
        self.seq_lens[:n_seqs].copy_(self._h_seq_lens[:n_seqs], non_blocking=nb)
        self.qsl[: n_seqs + 1].copy_(self._h_qsl[: n_seqs + 1], non_blocking=nb)
        self.table[:n_seqs, :max_blocks].copy_(self._h_table[:n_seqs, :max_blocks], non_blocking=nb)
