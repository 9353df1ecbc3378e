"""User input to engine requests: tokenize and validate a prompt (``process``), then build
the request's group of samples (``make_group``). Touches no scheduler state."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from paged_backend.core.kv_cache_manager import KVCacheManager
from paged_backend.core.request import Request
from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.engine.request_state import NEVER, PreparedRequest, RequestGroup, SampleState
from paged_backend.errors import InvalidRequestError
from paged_backend.sample.grammar import GrammarCompiler, RequestGrammar, SerializedGrammar
from paged_backend.sample.sampler import RowSpec, fast_greedy_from
from paged_backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def sample_id(request_id: str, n: int, index: int) -> str:
    """The scheduler's id of sample ``index`` of a request of ``n`` samples."""
    return request_id if n == 1 else f"{request_id}#{index}"


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], max_model_len: int,
                 kv: KVCacheManager, block_size: int, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.kv = kv
        self.block_size = block_size
        self.device = device
        # a text longer than this (UTF-8 bytes) has more than max_model_len tokens: refused untokenized
        self.max_prompt_bytes = max_model_len * max_token_bytes(tokenizer) if tokenizer else 0
        self._grammars: GrammarCompiler | None = None  # made at the first structured-output request

    def _compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of ``params.structured_outputs`` (None without); InvalidRequestError if bad."""
        spec = params.structured_outputs
        if spec is None:
            return None
        try:
            return self._compiler().compile(spec)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="structured_outputs") from None

    def load_grammar(self, serialized: SerializedGrammar) -> Any:
        """A grammar compiled by another process's ``InputProcessor`` over the same tokenizer."""
        return self._compiler().load(serialized)

    def _compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer; this model has none.",
                                      param="structured_outputs")
        if self._grammars is None:
            try:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            except ImportError:
                raise InvalidRequestError("structured outputs need the xgrammar package on this server "
                                          "(pip install 'paged-backend[structured]').",
                                          param="structured_outputs") from None
        return self._grammars

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.block_pool.num_total_usable * self.block_size

    def process(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                *, arrival_time: float | None = None, cache_salt: str | None = None) -> PreparedRequest:
        """Tokenize and validate; raises InvalidRequestError."""
        params = params or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise InvalidRequestError(
                f"Token id {bad} is out of vocabulary (vocab size {vocab}).", param="prompt")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError(
                f"stop_token_ids contains {bad_stop[0]}, outside the vocabulary (size {vocab}).",
                param="stop_token_ids")
        for field, tokens in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids",
                                                                       params.allowed_token_ids or ())):
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{field} contains token id {bad}, outside the vocabulary (size {vocab}).",
                                          param=field)
        max_tokens = self._max_tokens(len(ids), params)
        return PreparedRequest(request_id, text, ids, params, max_tokens,
                               time.monotonic() if arrival_time is None else arrival_time, cache_salt,
                               grammar=self._compile_grammar(params), bad_words_token_ids=self._bad_words(params))

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences (vLLM's rule): each word as it is, and with a leading space
        where that gives another first token and as many tokens."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need the model's tokenizer; this model has none.", param="bad_words")
        out: list[tuple[int, ...]] = []
        for word in params.bad_words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain or any(not 0 <= t < self.vocab_size for t in plain + spaced):
                raise InvalidRequestError(f"bad word {word[:40]!r} has no tokens in this model's vocabulary.",
                                          param="bad_words")
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return tuple(dict.fromkeys(out))

    def _prompt_ids(self, prompt: str | list[int] | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("This model has no tokenizer: send token ids.", param="prompt")
            if not prompt:
                raise InvalidRequestError("The prompt must not be empty.", param="prompt")
            self.check_text_size(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif prompt is None:
            raise InvalidRequestError("A prompt (text or token ids) is required.", param="prompt")
        else:
            text, ids = None, list(prompt)
            # set(map(type, ...)) runs in C; the exact check only when some id is not a plain int
            if set(map(type, ids)) - {int} and any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                raise InvalidRequestError("Prompt token ids must be integers.", param="prompt")
        if not ids:
            raise InvalidRequestError("The prompt must not be empty.", param="prompt")
        return text, ids

    def _max_tokens(self, n_prompt: int, params: SamplingParams) -> int:
        """The request's output limit, checked against the context and the whole KV cache."""
        if params.max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"prompt has {n_prompt} tokens, which leaves no room for a completion. Please reduce "
                    "the length of the prompt.", param="prompt", code="context_length_exceeded")
        else:
            max_tokens = params.max_tokens
            if n_prompt + max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} "
                    "in the completion). Please reduce the length of the messages or completion.",
                    param="max_tokens" if n_prompt < self.max_model_len else "prompt",
                    code="context_length_exceeded")
        if not self.kv.can_fit(n_prompt + max_tokens):
            raise InvalidRequestError(
                f"The request needs {n_prompt + max_tokens} tokens of KV cache but the whole cache holds "
                f"{self.kv_capacity_tokens}; it could never run.", param="max_tokens")
        return max_tokens

    def check_text_size(self, num_bytes: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text whose size alone proves it exceeds the context."""
        if self.max_prompt_bytes and num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"is {num_bytes} bytes long, more than {self.max_model_len} tokens of this tokenizer can hold "
                f"({self.max_prompt_bytes} bytes). Please reduce the length of the prompt.", param=param,
                code="context_length_exceeded")

    # -- the request's samples -----------------------------------------------------------

    def make_group(self, prep: PreparedRequest) -> RequestGroup:
        """The request's n samples; sample 0 computes the prompt, the others fork from it."""
        samples = [self._new_sample(prep, i) for i in range(prep.params.n)]
        group = RequestGroup(prep, samples, pending_forks=samples[1:], kind=prep.params.output_kind)
        if prep.params.prompt_logprobs is not None:
            group.prompt_logprobs, group.prompt_logprob_ranks = [None], [None]
        return group

    def _new_sample(self, prep: PreparedRequest, index: int) -> SampleState:
        params = prep.params
        rid = sample_id(prep.request_id, params.n, index)
        req = Request(rid, prep.prompt_token_ids, params, max_tokens=prep.max_tokens,
                      arrival_time=prep.arrival_time, cache_salt=prep.cache_salt,
                      eos_token_ids=self.eos_token_ids)
        req.sample_index = index
        req.parent_id = prep.request_id
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed + index)
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        fast_from = fast_greedy_from(params, self.eos_token_ids)
        max_output = min(prep.max_tokens, self.max_model_len - len(prep.prompt_token_ids))
        return SampleState(req, gen, detok, RowSpec.of(params, self.eos_token_ids, prep.bad_words_token_ids),
                           max_output,
                           fast_from=NEVER if fast_from is None else fast_from,
                           stop_ids=frozenset(stop_ids), wants_logprobs=params.logprobs is not None,
                           grammar=RequestGrammar(prep.grammar) if prep.grammar is not None else None)


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for.

    A vocabulary entry's own UTF-8 spelling is never shorter than the text it decodes to
    (byte-level BPE spells each byte with one character of 1-2 bytes; SentencePiece spells
    a space with the 3-byte ``\\u2581``; byte-fallback tokens spell one byte as ``<0xNN>``),
    so a text of more than ``max_model_len`` times this many bytes needs more tokens than
    the context holds.
    """
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    return max(longest, 4)


def load_tokenizer(path, required: bool):
    """The model's HF tokenizer; a random-weights (dummy) model may have none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        if required:
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
        logger.warning("no tokenizer in %s: token-id prompts only, no detokenization", path)
        return None
