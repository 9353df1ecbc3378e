"""``POST /chat/completions``: a conversation through the model's chat template, with
``n`` choices answered whole or streamed as SSE (a role chunk per choice, content chunks,
a finish chunk, an optional usage chunk, then ``data: [DONE]``). Tools, tool calls and
reasoning: ``openai_tools``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from paged_backend.outputs import RequestOutput

from .adapter_errors import AdapterError, to_adapter_error
from .openai_outputs import TokenText, chat_logprobs, prompt_logprobs, running_usage, usage_info
from .openai_protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
)
from .openai_sampling import chat_sampling_params
from .openai_state import app_adapter, app_options, app_request_ids, check_model
from .openai_streaming import (
    SSE_HEADERS,
    TextEvent,
    chain,
    collect,
    first_delta,
    sse,
    sse_error,
    until_disconnect,
)
from .openai_tools import (
    StreamedChoice,
    finish_reason,
    output_parser_factory,
    response_message,
    template_tool_calls,
    tool_request,
)
from .serving_options import ServingOptions, effective_cache_salt

logger = logging.getLogger(__name__)


def _message_dicts(messages: Sequence[ChatMessage], text_arguments: bool = False) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (past calls' arguments as mappings, or as JSON text when
    ``text_arguments``)."""
    if not messages:
        raise AdapterError("'messages' must contain at least one message.", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise AdapterError(f"messages[{i}]: only text content parts are supported "
                                           f"(got type {part.get('type')!r}).", param="messages")
                    texts.append(part["text"])
                else:
                    texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = template_tool_calls(m.tool_calls, i, text_arguments)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


# chat_template_kwargs names that are apply_chat_template's own arguments, not template variables
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "tokenize", "add_generation_prompt", "continue_final_message", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def chat_template_kwargs(body: ChatCompletionRequest, options: ServingOptions) -> dict[str, Any]:
    """The template variables a chat request passes; a template of its own only when trusted.

    A request-supplied Jinja template can spend unbounded CPU and memory in the sandbox,
    so it is refused unless the operator set ``trust_request_chat_template``."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    if body.chat_template is not None:
        template = body.chat_template
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise AdapterError(f"chat_template_kwargs may not set '{bad[0]}'.", param="chat_template_kwargs")
    if template is not None:
        if not options.trust_request_chat_template:
            raise AdapterError("This server does not accept chat templates sent with a request (chat_template); "
                               "the model's own template is used.", param="chat_template",
                               code="chat_template_not_allowed")
        if not isinstance(template, str):
            raise AdapterError("chat_template must be a string.", param="chat_template")
        kwargs["chat_template"] = template
    return kwargs


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    adapter, options = app_adapter(request), app_options(request)
    check_model(adapter, body.model)
    tools = tool_request(body, options)
    params, names = chat_sampling_params(body, tools.constraint)
    template_kwargs = chat_template_kwargs(body, options)
    if tools.tools:
        template_kwargs["tools"] = tools.tools
    make_parser = output_parser_factory(tools, options)  # None: the output is plain content
    prompt_tail: list[str] = []  # the rendered prompt's end: did the template open a reasoning block?
    messages = _message_dicts(body.messages)
    has_calls = any(m.tool_calls for m in body.messages)
    salt = effective_cache_salt(body.cache_salt, body.user, from_user=options.cache_salt_from_user)
    rid = f"chatcmpl-{uuid.uuid4().hex}"  # the engine's id: made here, never from user input
    response_id = f"chatcmpl-{body.request_id}" if body.request_id is not None else rid
    release = app_request_ids(request).claim(body.request_id, [rid], adapter)
    handed_off = False
    try:
        async def start() -> tuple[AsyncIterator[RequestOutput], RequestOutput | None]:
            try:
                prompt_ids = await adapter.encode_chat_async(messages, add_generation_prompt=body.add_generation_prompt,
                                                             chat_template_kwargs=template_kwargs)
            except AdapterError:
                if not has_calls:
                    raise
                # a template that concatenates past calls' arguments as text (DeepSeek-V3's) gets the JSON text
                prompt_ids = await adapter.encode_chat_async(_message_dicts(body.messages, text_arguments=True),
                                                             add_generation_prompt=body.add_generation_prompt,
                                                             chat_template_kwargs=template_kwargs)
            if make_parser is not None:
                prompt_tail.append(adapter.tokenizer.decode(prompt_ids[-16:]))
            stream = adapter.generate(prompt_ids, params, request_id=rid, cache_salt=salt, field_names=names)
            try:
                return stream, await first_delta(stream)
            except BaseException:
                await stream.aclose()
                raise

        # the client may leave while the prompt is tokenized or prefilled: its request is aborted then
        stream, first = await until_disconnect(request, start())
        model = adapter.served_model_name
        text = TokenText(adapter.tokenizer) if body.logprobs else None
        k = body.top_logprobs or 0
        details = options.enable_prompt_tokens_details
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.wants_usage)
            gen = _chat_stream(response_id, model, params.n, first, stream, text, k, include_usage, details,
                               on_close=release, return_token_ids=bool(body.return_token_ids),
                               continuous_usage=bool(body.stream_options and body.stream_options.continuous),
                               make_stream=(lambda: StreamedChoice(make_parser("".join(prompt_tail))))
                               if make_parser is not None else None)
            handed_off = True
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        final = await until_disconnect(request, collect(stream, first))
    finally:
        if not handed_off:
            release()
    choices = []
    ids = bool(body.return_token_ids)
    for c in final.outputs if final is not None else []:
        lp = chat_logprobs(c.token_ids, c.logprobs or [], k, text) if text is not None else None
        message, reason = ChatResponseMessage(content=c.text), c.finish_reason
        if make_parser is not None:
            message = response_message(make_parser("".join(prompt_tail)).parse(c.text, final=True))
            reason = finish_reason(reason, bool(message.tool_calls))
        choices.append(ChatCompletionChoice(index=c.index, message=message, logprobs=lp,
                                            finish_reason=reason, stop_reason=c.stop_reason,
                                            token_ids=list(c.token_ids) if ids else None))
    resp = ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=usage_info([final], details))
    if final is not None and body.prompt_logprobs is not None:
        resp.prompt_logprobs = prompt_logprobs(final, body.prompt_logprobs, TokenText(adapter.tokenizer))
    if final is not None and ids:
        resp.prompt_token_ids = list(final.prompt_token_ids)
    return JSONResponse(resp.model_dump())


async def _chat_stream(rid: str, model: str, n: int, first: RequestOutput | None, stream: AsyncIterator[RequestOutput],
                       text: TokenText | None, k: int, include_usage: bool, details: bool,
                       on_close: Callable[[], None], return_token_ids: bool = False,
                       continuous_usage: bool = False,
                       make_stream: Callable[[], StreamedChoice] | None = None) -> AsyncIterator[str]:
    """SSE events of a chat stream; the events of one delta go out in one write. ``return_token_ids``: the
    prompt's ids on the first chunk, each chunk's new ids on its choice; ``continuous_usage``: every chunk
    carries its choice's usage so far; ``make_stream``: each choice's output read as reasoning, content and
    tool calls (``openai_tools``), else it is all content."""
    created = int(time.time())
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    content_events: dict[int, TextEvent] = {}
    num_prompt = first.usage.prompt_tokens if first is not None else 0
    parsed: dict[int, StreamedChoice] = {}

    def chunk(choice: ChatCompletionStreamChoice, completion_tokens: int = 0, **more: Any) -> str:
        if continuous_usage:
            more["usage"] = running_usage(num_prompt, completion_tokens)
        return sse(ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=model,
                                       choices=[choice], **{**extra, **more}))

    def content(index: int, s: str) -> str:
        event = content_events.get(index)
        if event is None:
            event = content_events[index] = TextEvent(lambda t: ChatCompletionChunk(
                id=rid, object="chat.completion.chunk", created=created, model=model,
                choices=[ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=t), logprobs=None,
                                                    finish_reason=None)], **extra))
        return event(s)

    def events(delta: RequestOutput) -> str:
        out = []
        for c in delta.outputs:
            ids: dict[str, Any] = {"token_ids": list(c.token_ids)} if return_token_ids else {}
            if make_stream is not None:
                out.extend(parsed_events(c, ids))
                continue
            if (text is not None or return_token_ids) and (c.text or c.token_ids):
                lp = chat_logprobs(c.token_ids, c.logprobs or [], k, text) if text is not None else None
                out.append(chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                            logprobs=lp, finish_reason=None, **ids),
                                 c.num_output_tokens))
            elif c.text:
                out.append(chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                            logprobs=None, finish_reason=None), c.num_output_tokens)
                           if continuous_usage else content(c.index, c.text))
            if c.finish_reason is not None:
                out.append(chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(),
                                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason),
                                 c.num_output_tokens))
        return "".join(out)

    def parsed_events(c: Any, ids: dict[str, Any]) -> list[str]:
        sp = parsed.get(c.index)
        if sp is None:
            sp = parsed[c.index] = make_stream()  # type: ignore[misc]
        done = c.finish_reason is not None
        deltas = sp.feed(c.text, done) if c.text or done else []
        lp = chat_logprobs(c.token_ids, c.logprobs or [], k, text) if text is not None and c.token_ids else None
        if not deltas and (lp is not None or (ids and c.token_ids)):
            deltas = [DeltaMessage()]
        out = [chunk(ChatCompletionStreamChoice(index=c.index, delta=d, logprobs=lp if j == 0 else None,
                                                finish_reason=None, **(ids if j == 0 else {})), c.num_output_tokens)
               for j, d in enumerate(deltas)]
        if done:
            out.append(chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(),
                                                        finish_reason=finish_reason(c.finish_reason, sp.called),
                                                        stop_reason=c.stop_reason), c.num_output_tokens))
        return out

    last: RequestOutput | None = None
    try:
        # the role chunks go out with the first delta's events
        prompt_ids = {"prompt_token_ids": list(first.prompt_token_ids)} if return_token_ids and first else {}
        head = "".join(chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                                        logprobs=None, finish_reason=None), 0,
                             **(prompt_ids if i == 0 else {})) for i in range(n))
        async for delta in chain(first, stream):
            last = delta
            out, head = head + events(delta), ""
            if out:
                yield out
        if head:
            yield head
        if include_usage:
            yield sse(ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=created, model=model,
                                          choices=[], usage=usage_info([last], details)))
    except AdapterError as err:
        yield sse_error(err)
    except Exception as exc:  # after the headers went out an error can only be an SSE event
        logger.exception("error while streaming %s", rid)
        yield sse_error(to_adapter_error(exc))
    finally:
        await stream.aclose()  # a client gone mid-stream lands here: abort, free the blocks
        on_close()
    yield "data: [DONE]\n\n"
