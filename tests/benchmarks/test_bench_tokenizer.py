"""A tokenizer for random-weights models of real shapes: SmolLM2's, padded to Llama-3's vocab size."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers.decoders import DecodeStream

from paged_backend.benchmarks.model_shapes import MODEL_SHAPES, pad_tokenizer, write_shape_config

W1_VOCAB = MODEL_SHAPES["llama-3.2-1b"]["vocab_size"]  # 128256
TEXTS = [
    "The capital of France is Paris.",
    "  def fibonacci(n):\n\treturn n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # recursion\n",
    "Unicode: café, naïve, Straße, 中文, 日本語, emoji 🙂👍, math ∑∫≠, tabs\tand\r\nnewlines",
    "aaa aab zzzz qxj Ġabc <|im_start|>user\nhi<|im_end|>",
    "1, 2, 3, 4, 5, 6, 10000000, 3.14159, -42e-3",
]


@pytest.fixture(scope="module")
def smol_dir() -> str:
    from smollm2 import model_dir

    return model_dir()


@pytest.fixture(scope="module")
def padded(smol_dir, tmp_path_factory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("padded")
    return out, pad_tokenizer(smol_dir, out, W1_VOCAB)


def test_padded_tokenizer_has_the_model_vocab_and_encodes_text_as_before(smol_dir, padded):
    from transformers import AutoTokenizer

    out, added = padded
    orig = AutoTokenizer.from_pretrained(smol_dir)
    tok = AutoTokenizer.from_pretrained(out)
    assert added == W1_VOCAB - len(orig) == W1_VOCAB - 49152
    assert len(tok) == tok.vocab_size == W1_VOCAB
    assert tok.all_special_ids == orig.all_special_ids
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (orig.bos_token_id, orig.eos_token_id,
                                                                      orig.pad_token_id)
    rng = random.Random(0)
    # text decoded from random original ids (how `bench serve` builds its prompts) plus the fixed texts
    texts = TEXTS + [orig.decode([rng.randrange(len(orig)) for _ in range(200)]) for _ in range(50)]
    for text in texts:
        assert tok.encode(text) == orig.encode(text), text
    chat = [{"role": "user", "content": TEXTS[0]}]
    assert tok.apply_chat_template(chat, tokenize=False) == orig.apply_chat_template(chat, tokenize=False)


def test_every_padded_id_decodes_to_a_space_and_letters(padded):
    from transformers import AutoTokenizer

    out, _ = padded
    tok = AutoTokenizer.from_pretrained(out)
    ids = list(range(49152, W1_VOCAB))
    pieces = tok.convert_ids_to_tokens(ids)
    assert len(set(pieces)) == len(ids)
    assert all(p[0] == "\u0120" and p[1:].isascii() and p[1:].isalpha() and 3 <= len(p) - 1 <= 4 for p in pieces)
    assert tok.convert_tokens_to_ids(pieces) == ids
    sample = [49152, 49153, 100000, W1_VOCAB - 1]
    text = tok.decode(sample)
    assert text == "".join(" " + p[1:] for p in tok.convert_ids_to_tokens(sample))
    # a padded id encodes back to ordinary tokens: merges never produce the new entries
    assert all(i < 49152 for i in tok.encode(text))
    # mixed with original ids and special tokens, streamed the way the engine detokenizes
    mixed = [1, 504, 49152, 2, 28, W1_VOCAB - 1, 80000, 0]
    stream = DecodeStream(skip_special_tokens=True)
    streamed = "".join(stream.step(tok.backend_tokenizer, i) or "" for i in mixed)
    assert streamed == tok.decode(mixed, skip_special_tokens=True)


def test_shape_dir_with_tokenizer(smol_dir):
    from transformers import AutoConfig, AutoTokenizer

    d = Path(write_shape_config("llama-3.2-1b", tokenizer_from=smol_dir))
    bare = Path(write_shape_config("llama-3.2-1b"))
    try:
        cfg = AutoConfig.from_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)  # next to a llama config.json: still the byte-level tokenizer
        orig = AutoTokenizer.from_pretrained(smol_dir)
        assert cfg.vocab_size == len(tok) == W1_VOCAB
        assert all(tok.encode(text) == orig.encode(text) for text in TEXTS)
        assert tok.decode([49152, W1_VOCAB - 1]) == " aaa dpjx"
        assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
        assert sorted(p.name for p in d.iterdir()) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                         "tokenizer_config.json"]
        assert [p.name for p in bare.iterdir()] == ["config.json"]
    finally:
        shutil.rmtree(d)
        shutil.rmtree(bare)


def test_pad_to_the_tokenizer_own_size_adds_nothing(smol_dir, tmp_path):
    """A tokenizer that already fills the vocabulary is copied as it is (this once looped forever)."""
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(smol_dir))
    assert pad_tokenizer(smol_dir, tmp_path / "same", n) == 0
    assert len(AutoTokenizer.from_pretrained(tmp_path / "same")) == n


def test_pad_refuses_what_it_cannot_pad(smol_dir, tmp_path):
    with pytest.raises(ValueError, match="not below vocab_size"):
        pad_tokenizer(smol_dir, tmp_path / "small", 1000)
    spec = json.loads((Path(smol_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    spec["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    src = tmp_path / "metaspace"
    src.mkdir()
    (src / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="only byte-level BPE"):
        pad_tokenizer(src, tmp_path / "out", W1_VOCAB)
    assert not (tmp_path / "small").exists() and not (tmp_path / "out").exists()
