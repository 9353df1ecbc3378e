"""Engine counters and the periodic log line (vLLM's "Avg prompt throughput ..." line)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

logger = logging.getLogger("paged_backend")
_computed = attrgetter("num_computed_tokens")
STEP_TOKENS_KEPT = 1 << 16  # per-step token counts kept for a metrics reader (the oldest dropped past this)


def take_all(items: deque) -> list:
    """Remove and return what ``items`` holds, oldest first (any thread: deque pops are atomic, and an
    item appended meanwhile stays for the next call)."""
    out = []
    pop = items.popleft
    try:
        for _ in range(len(items)):
            out.append(pop())
    except IndexError:
        pass
    return out


@dataclass
class EngineStats:
    interval: float = 10.0  # seconds between log lines; 0 = never log
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    computed_tokens_total: int = 0
    num_requests_total: int = 0
    num_finished_total: int = 0
    num_aborted_total: int = 0
    num_preemptions_total: int = 0
    num_steps: int = 0
    peak_kv_usage: float = 0.0
    peak_kv_waste: float = 0.0  # allocated slots holding no token / allocated slots, at peak usage
    # tokens computed by each step since a reader last took them (vLLM's iteration_tokens_total)
    step_tokens: deque = field(default_factory=lambda: deque(maxlen=STEP_TOKENS_KEPT))
    # speculative decoding: the verifier's counters (engine/spec_decoding.py SpecDecodeStats), when on
    spec: Any = None
    _last_log: float = field(default_factory=time.monotonic)
    _last_prompt: int = 0
    _last_gen: int = 0
    _last_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])

    def on_request_added(self, prompt_tokens: int) -> None:
        self.num_requests_total += 1
        self.prompt_tokens_total += prompt_tokens

    def on_request_finished(self, aborted: bool) -> None:
        self.num_finished_total += 1
        self.num_aborted_total += int(aborted)

    def on_preemptions(self, n: int) -> None:
        self.num_preemptions_total += n

    def on_step(self, computed_tokens: int, sampled_tokens: int, scheduler, kv) -> None:
        self.num_steps += 1
        self.computed_tokens_total += computed_tokens
        self.step_tokens.append(computed_tokens)
        self.generation_tokens_total += sampled_tokens
        usage = kv.usage
        if usage >= self.peak_kv_usage:
            self.peak_kv_usage = usage
            allocated = kv.allocated_slots()
            if allocated:
                # computed tokens never exceed known ones (the scheduler schedules at most
                # num_tokens - num_computed), so this counts the filled slots; C-level sum
                filled = sum(map(_computed, scheduler.running))
                self.peak_kv_waste = max(0.0, 1.0 - filled / allocated)
        now = time.monotonic()
        if self.interval and now - self._last_log >= self.interval:
            self.log(scheduler, kv, now)

    def take_step_tokens(self) -> list[int]:
        """The tokens of each step since the last call (any thread)."""
        return take_all(self.step_tokens)

    def log(self, scheduler, kv, now: float) -> None:
        dt = max(now - self._last_log, 1e-9)
        rate = kv.stats.hit_rate
        host = kv.host  # the prefix cache's host tier (--swap-space), or None
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s",
            (self.prompt_tokens_total - self._last_prompt) / dt,
            (self.generation_tokens_total - self._last_gen) / dt,
            scheduler.num_running, scheduler.num_waiting, 100 * kv.usage, 100 * rate,
            "" if host is None else f", Swapped: {scheduler.num_swapped} reqs, "
            f"Host prefix cache hit rate: {100 * host.stats.hit_rate:.1f}%",
        )
        if self.spec is not None:
            self._log_spec(self.spec)
        self._last_log, self._last_prompt, self._last_gen = now, self.prompt_tokens_total, self.generation_tokens_total

    def _log_spec(self, spec: Any) -> None:
        """vLLM's SpecDecoding line over the drafts verified since the last one."""
        drafts, draft_tokens, accepted = spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
        per_pos = list(spec.accepted_per_pos)
        last_drafts, last_tokens, last_accepted, last_per_pos = self._last_spec
        d_drafts, d_tokens, d_accepted = drafts - last_drafts, draft_tokens - last_tokens, accepted - last_accepted
        rates = ", ".join(f"{(n - (last_per_pos[i] if i < len(last_per_pos) else 0)) / d_drafts:.3f}"
                          for i, n in enumerate(per_pos)) if d_drafts else "-"
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1.0 + d_accepted / d_drafts if d_drafts else 0.0, d_accepted, d_tokens, rates,
            100.0 * d_accepted / d_tokens if d_tokens else 0.0)
        self._last_spec = (drafts, draft_tokens, accepted, per_pos)

    def snapshot(self, scheduler, kv) -> dict:
        hits = kv.stats
        host = kv.host.stats if kv.host is not None else None
        return {
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "num_swapped": scheduler.num_swapped,
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "prefix_cache_queries": hits.queries,
            "prefix_cache_hits": hits.hits,  # the device tier's
            # the host tier's (prefix tokens that missed on the device and were copied back from the host)
            "host_prefix_cache_queries": host.queries if host is not None else 0,
            "host_prefix_cache_hits": host.hits if host is not None else 0,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_requests_total": self.num_requests_total,
            "num_finished_total": self.num_finished_total,
            "num_aborted_total": self.num_aborted_total,
            "num_preemptions": self.num_preemptions_total,
            "peak_kv_usage": self.peak_kv_usage,
            "peak_kv_waste": self.peak_kv_waste,
        } | (self.spec.snapshot() if self.spec is not None else {})
