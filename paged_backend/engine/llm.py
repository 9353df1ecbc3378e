"""Offline batch inference: ``LLM(model, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from paged_backend.config import EngineConfig
from paged_backend.engine.beam_search import BeamSearchRunner
from paged_backend.engine.gc_heap import frozen_heap
from paged_backend.engine.llm_engine import LLMEngine
from paged_backend.outputs import RequestOutput
from paged_backend.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """vLLM-style offline API; engine arguments are EngineConfig's fields (vLLM's flag names)."""

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); idempotent, also run at exit."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in input order; each holds the full texts / token ids of its n samples."""
        with frozen_heap():
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        beam = [i for i, p in enumerate(params) if p.use_beam_search]
        results: dict[int, RequestOutput] = {}
        if beam:
            runner = BeamSearchRunner(self.engine)
            for i, out in zip(beam, runner.run([prompts[i] for i in beam], [params[i] for i in beam]), strict=True):
                results[i] = out
        plain = [i for i in range(len(prompts)) if i not in results]
        ids = {}
        final_only: dict[int, SamplingParams] = {}  # one copy per distinct params object
        for i in plain:
            rid = f"llm-{next(self._ids)}"
            p = params[i]
            if p.output_kind is not RequestOutputKind.FINAL_ONLY:
                if id(p) not in final_only:
                    final_only[id(p)] = p.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})
                p = final_only[id(p)]
            self.engine.add_request(rid, prompts[i], p)
            ids[rid] = i
        finals = self._run(ids, use_tqdm)
        results.update(finals)
        return [results[i] for i in range(len(prompts))]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, through the tokenizer's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {}))
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **kw)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, ids: dict[str, int], use_tqdm: bool) -> dict[int, RequestOutput]:
        """Step the engine until every request in ``ids`` finished (FINAL_ONLY: the engine emits
        one complete output per request, when it finishes)."""
        finals: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or not ids)
        while len(finals) < len(ids):
            for out in self.engine.step():
                i = ids.get(out.request_id)
                if i is not None and out.finished:
                    finals[i] = out
                    bar.update(1)
        bar.close()
        return finals


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
