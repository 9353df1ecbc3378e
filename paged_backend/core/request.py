"""A request as the scheduler and the KV-cache manager see it (no torch here).

There is no prefill or decode phase: a request has ``num_tokens`` (prompt + output so
far) and ``num_computed_tokens`` (how many of those have K/V in the cache). Prefill,
chunked prefill, prefix hits, recompute after preemption and decode are the same loop.
"""

from __future__ import annotations

import enum
import time

from paged_backend.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3  # preempted by swap: its computed blocks wait in the host tier
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.eos_token_ids = eos_token_ids
        # prompt positions whose logits the step inputs gather (prompt logprobs), else 0
        self.num_prompt_logits = len(self.prompt_token_ids) - 1 if sampling_params.prompt_logprobs is not None else 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.first_scheduled_time: float | None = None  # time.monotonic() when first scheduled (queue end)
        self.num_preemptions = 0
        # ``is_finished`` is a plain attribute kept in step with ``status`` by its setter: the
        # engine reads it for every request every step, an enum property chain costs ~10x more
        self.is_finished = False
        self._status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # sha256 digests of the full blocks of all_token_ids, maintained by the KV manager
        self.block_hashes: list[bytes] = []
        self.scheduled_step = -1  # the scheduler's step counter when it was last scheduled
        # async scheduling: 1 while a sampled token of this request is still on the device (its
        # step is in flight); the scheduler counts it, the runner reads it from the device
        self.num_pending = 0
        # speculative decoding: draft tokens proposed to follow all_token_ids, verified by the next
        # step that schedules this request (then replaced by the next proposal)
        self.spec_token_ids: list[int] = []
        # set by the engine: index among the n samples, and the parent id (n > 1)
        self.sample_index = 0
        self.parent_id: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, status: RequestStatus) -> None:
        self._status = status
        self.is_finished = status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
