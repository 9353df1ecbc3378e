"""``POST /completions``: one or several prompts (text or token ids), each with ``n``
completions, answered whole or streamed as SSE; ``echo`` puts the prompt (and, with
``logprobs``, its logprobs) before the generated text.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend.engine.async_engine import gather_all
from paged_backend.outputs import CompletionOutput, LogprobsDict, RequestOutput

from .adapter_errors import AdapterError, to_adapter_error
from .openai_outputs import (
    TokenText,
    completion_logprobs,
    extend_logprobs,
    prompt_logprobs,
    running_usage,
    usage_info,
)
from .openai_protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from .openai_sampling import completion_sampling_params
from .openai_state import app_adapter, app_options, app_request_ids, check_model
from .openai_streaming import (
    SSE_HEADERS,
    TextEvent,
    chain,
    collect,
    first_delta,
    merge_streams,
    sse,
    sse_error,
    until_disconnect,
)
from .serving_options import effective_cache_salt

logger = logging.getLogger(__name__)


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise AdapterError("'prompt' must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


async def create_completion(body: CompletionRequest, request: Request) -> Any:
    adapter, options = app_adapter(request), app_options(request)
    check_model(adapter, body.model)
    if body.suffix is not None:
        raise AdapterError("'suffix' is not supported.", param="suffix")
    params, names = completion_sampling_params(body)
    prompts = _prompts(body.prompt)
    if len(prompts) * params.n > options.max_batch_prompts:
        raise AdapterError(f"This request asks for {len(prompts)} prompt(s) x n = {params.n} completions, more than "
                           f"this server takes in one request ({options.max_batch_prompts}).", param="prompt",
                           code="too_many_prompts")
    salt = effective_cache_salt(body.cache_salt, body.user, from_user=options.cache_salt_from_user)
    rid = f"cmpl-{uuid.uuid4().hex}"  # the engine's ids: made here, never from user input
    engine_ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    response_id = f"cmpl-{body.request_id}" if body.request_id is not None else rid
    release = app_request_ids(request).claim(body.request_id, engine_ids, adapter)
    handed_off = False
    # every prompt is submitted at once (one batch in the engine); any refusal or a client
    # gone before the last token aborts them all
    streams = [adapter.generate(p, params, request_id=eid, cache_salt=salt, field_names=names)
               for p, eid in zip(prompts, engine_ids, strict=True)]
    try:
        firsts = await until_disconnect(request, gather_all([first_delta(s) for s in streams]))
        tok = adapter.tokenizer
        text = TokenText(tok)
        echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in prompts]
        model = adapter.served_model_name
        details = options.enable_prompt_tokens_details
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.wants_usage)
            gen = _completion_stream(response_id, model, params.n, firsts, streams, echoes, body, text, include_usage,
                                     details, on_close=release)
            handed_off = True
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        finals = await until_disconnect(request, gather_all([collect(s, f) for f, s in zip(firsts, streams,
                                                                                            strict=True)]))
    finally:
        if not handed_off:  # the streaming response owns them otherwise
            for s in streams:
                await s.aclose()
            release()
    choices = _completion_choices(finals, body, params.n, echoes, text)
    resp = CompletionResponse(id=response_id, model=model, choices=choices, usage=usage_info(finals, details))
    return JSONResponse(resp.model_dump())


def _completion_choices(finals: list[RequestOutput | None], body: CompletionRequest, n: int, echoes: list[str],
                        text: TokenText) -> list[CompletionChoice]:
    """The choices of a whole response, prompt by prompt (choice index = prompt index * n + c)."""
    choices = []
    for pi, final in enumerate(finals):
        if final is None:
            continue
        for c in final.outputs:
            lp = None
            if body.logprobs is not None:
                lp, offset = CompletionLogprobs(), 0
                if body.echo and final.prompt_logprobs is not None:
                    lp, offset = completion_logprobs(final.prompt_token_ids, final.prompt_logprobs, body.logprobs,
                                                     text, 0)
                gen_lp, _ = completion_logprobs(c.token_ids, c.logprobs or [], body.logprobs, text, offset)
                extend_logprobs(lp, gen_lp)
            ids = bool(body.return_token_ids)
            choices.append(CompletionChoice(
                index=pi * n + c.index, text=echoes[pi] + c.text, logprobs=lp, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=prompt_logprobs(final, body.prompt_logprobs, text)
                if body.prompt_logprobs is not None else None,
                prompt_token_ids=list(final.prompt_token_ids) if ids else None,
                token_ids=list(c.token_ids) if ids else None))
    return choices


class _CompletionEvents:
    """The SSE events of each delta of a completion stream, as one string.

    A choice's first event starts with its prompt's echo (and, with ``echo`` and
    ``logprobs``, the prompt's logprobs); logprobs' text offsets count on across deltas.
    ``return_token_ids``: a choice's first event carries its prompt's ids, every event its new ids;
    ``continuous_usage_stats``: every event carries its choice's usage so far.
    """

    def __init__(self, rid: str, model: str, n: int, echoes: list[str], body: CompletionRequest, text: TokenText,
                 include_usage: bool) -> None:
        self.rid, self.model, self.n, self.echoes, self.body, self.text = rid, model, n, echoes, body, text
        self.created = int(time.time())
        self.extra: dict[str, Any] = {"usage": None} if include_usage else {}
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.last: dict[int, RequestOutput] = {}  # the latest delta of each prompt: its usage is the total so far
        self.prompt_logprobs: dict[int, list[LogprobsDict | None]] = {}
        self.text_events: dict[int, TextEvent] = {}
        self.token_ids = bool(body.return_token_ids)
        self.sent_prompt_ids: set[int] = set()
        self.continuous = bool(body.stream_options and body.stream_options.continuous)

    def _response(self, choices: list[CompletionChoice], **fields: Any) -> CompletionResponse:
        return CompletionResponse(id=self.rid, object="text_completion", created=self.created, model=self.model,
                                  choices=choices, **fields)

    def _chunk(self, choice: CompletionChoice, usage: tuple[RequestOutput, CompletionOutput] | None = None) -> str:
        extra = self.extra
        if self.continuous and usage is not None:
            extra = {"usage": running_usage(usage[0].usage.prompt_tokens, usage[1].num_output_tokens)}
        return sse(self._response([choice], **extra))

    def _text_chunk(self, index: int, s: str) -> str:
        event = self.text_events.get(index)
        if event is None:
            event = self.text_events[index] = TextEvent(lambda t: self._response(
                [CompletionChoice(index=index, text=t, logprobs=None, finish_reason=None)], **self.extra))
        return event(s)

    def __call__(self, pi: int, delta: RequestOutput) -> str:
        """The events of a delta of prompt ``pi``."""
        self.last[pi] = delta
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[pi] = delta.prompt_logprobs
        return "".join(self._choice_events(pi, delta, c) for c in delta.outputs)

    def _choice_events(self, pi: int, delta: RequestOutput, c: CompletionOutput) -> str:
        k, index, text = self.body.logprobs, pi * self.n + c.index, self.text
        out = []
        prefix, lp = "", None
        if k is not None:
            lp = CompletionLogprobs()
        if index not in self.echoed:
            self.echoed.add(index)
            prefix = self.echoes[pi]
            if k is not None and self.body.echo and pi in self.prompt_logprobs:
                lp, self.offsets[index] = completion_logprobs(delta.prompt_token_ids, self.prompt_logprobs[pi], k,
                                                              text, 0)
        ids: dict[str, Any] = {"token_ids": list(c.token_ids)} if self.token_ids else {}
        first = self.token_ids and index not in self.sent_prompt_ids
        if first:
            self.sent_prompt_ids.add(index)
            ids["prompt_token_ids"] = list(delta.prompt_token_ids)
        if prefix or c.text or ((k is not None or self.token_ids) and c.token_ids) or first:
            if lp is not None:
                more, self.offsets[index] = completion_logprobs(c.token_ids, c.logprobs or [], k, text,
                                                                self.offsets.get(index, 0))
                extend_logprobs(lp, more)
                out.append(self._chunk(CompletionChoice(index=index, text=prefix + c.text, logprobs=lp,
                                                        finish_reason=None, **ids), (delta, c)))
            elif ids or self.continuous:
                out.append(self._chunk(CompletionChoice(index=index, text=prefix + c.text, logprobs=None,
                                                        finish_reason=None, **ids), (delta, c)))
            else:
                out.append(self._text_chunk(index, prefix + c.text))
        if c.finish_reason is not None:
            out.append(self._chunk(CompletionChoice(index=index, text="", finish_reason=c.finish_reason,
                                                    stop_reason=c.stop_reason), (delta, c)))
        return "".join(out)

    def usage(self, details: bool) -> str:
        """The closing usage event: the totals of every prompt's latest delta."""
        return sse(self._response([], usage=usage_info(list(self.last.values()), details)))


async def _completion_stream(rid: str, model: str, n: int, firsts: list[RequestOutput | None],
                             streams: list[AsyncIterator[RequestOutput]], echoes: list[str], body: CompletionRequest,
                             text: TokenText, include_usage: bool, details: bool,
                             on_close: Callable[[], None]) -> AsyncIterator[str]:
    """SSE events of a completion stream; the events of one delta go out in one write."""
    events = _CompletionEvents(rid, model, n, echoes, body, text, include_usage)
    try:
        async for pi, delta in merge_streams([chain(f, s) for f, s in zip(firsts, streams, strict=True)]):
            out = events(pi, delta)
            if out:
                yield out
        if include_usage:
            yield events.usage(details)
    except AdapterError as err:
        yield sse_error(err)
    except Exception as exc:
        logger.exception("error while streaming %s", rid)
        yield sse_error(to_adapter_error(exc))
    finally:
        for s in streams:
            await s.aclose()
        on_close()
    yield "data: [DONE]\n\n"
