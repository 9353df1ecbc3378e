"""Engine outputs as parts of OpenAI responses: token usage, and logprobs in the chat
(``content`` list) and the completions (parallel lists with text offsets) shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paged_backend.outputs import LogprobsDict, RequestOutput

from .openai_protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)


def usage_info(outs: Sequence[RequestOutput | None], details: bool = True) -> UsageInfo:
    """The summed usage of these outputs; cached prompt tokens only when ``details``."""
    prompt = sum(o.usage.prompt_tokens for o in outs if o is not None)
    completion = sum(o.usage.completion_tokens for o in outs if o is not None)
    cached = sum(o.usage.cached_tokens for o in outs if o is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if details else None)


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The usage on a chunk of a stream with ``continuous_usage_stats`` (vLLM's: its choice's tokens so far)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


class TokenText:
    """Decoded text of single tokens, cached (logprobs name tokens by their text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _top(d: LogprobsDict, k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:k]


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[LogprobsDict], k: int,
                  text: TokenText) -> ChatChoiceLogprobs:
    content = []
    for tid, d in zip(token_ids, logprobs, strict=False):
        s = text(tid)
        tops = [TopLogprob(token=text(t), logprob=max(lp, -9999.0), bytes=list(text(t).encode()))
                for t, lp in _top(d, k)]
        content.append(ChatTokenLogprob(token=s, logprob=max(d.get(tid, float("-inf")), -9999.0),
                                        bytes=list(s.encode()), top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[LogprobsDict | None], k: int,
                        text: TokenText, offset: int) -> tuple[CompletionLogprobs, int]:
    """Completions logprobs of these tokens, their text offsets counted on from ``offset``;
    also returns the offset after them."""
    out = CompletionLogprobs()
    for tid, d in zip(token_ids, logprobs, strict=False):
        s = text(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if d is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(d.get(tid, float("-inf")), -9999.0))
        tops = dict(_top(d, k))
        tops[tid] = d.get(tid, float("-inf"))  # vLLM lists the chosen token too
        out.top_logprobs.append({text(t): max(lp, -9999.0) for t, lp in tops.items()})
    return out, offset


def extend_logprobs(acc: CompletionLogprobs, more: CompletionLogprobs) -> None:
    acc.tokens += more.tokens
    acc.token_logprobs += more.token_logprobs
    acc.top_logprobs += more.top_logprobs
    acc.text_offset += more.text_offset


def prompt_logprobs(out: RequestOutput, k: int, text: TokenText) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a response: null for the first prompt token, then per position the
    prompt token (its rank in the whole vocabulary) and the top ``k`` (ranks 1..k), -inf as -9999.0."""
    if out.prompt_logprobs is None:
        return None
    ranks = out.prompt_logprob_ranks or []
    entries: PromptLogprobs = []
    for pos, d in enumerate(out.prompt_logprobs):
        if d is None or pos >= len(out.prompt_token_ids):
            entries.append(None)
            continue
        tid = out.prompt_token_ids[pos]
        rank = ranks[pos] if pos < len(ranks) else None
        entry = {tid: PromptLogprob(logprob=max(d.get(tid, float("-inf")), -9999.0), rank=rank,
                                    decoded_token=text(tid))}
        for r, (t, lp) in enumerate(_top(d, k)):
            entry[t] = PromptLogprob(logprob=max(lp, -9999.0), rank=r + 1, decoded_token=text(t))
        entries.append(entry)
    return entries
