"""ModelInfo parsing and the safetensors loader: structure, formats and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_fixtures import TINY, PagedCache, hf_classes, make_meta, make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from paged_backend.attention.torch_attn import TorchAttentionBackend
from paged_backend.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq
from paged_backend.models.model_info import ModelInfo
from paged_backend.worker.model_loader import load_model, resolve_dtype

CPU = torch.device("cpu")


def _load(path: Path, dtype: torch.dtype = torch.float32, load_format: str = "auto"):
    return load_model(path, ModelInfo.from_dir(path), dtype, CPU, TorchAttentionBackend(), load_format)


def _write_config(path: Path, cfg: dict, gen: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tied tiny Llama in one model.safetensors."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "llama", "LlamaForCausalLM", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("ck") / "untied", "LlamaForCausalLM", tie_word_embeddings=False,
        save_kwargs={"max_shard_size": "60KB"},
    )


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    """Copies a one-file checkpoint to ``dst`` with ``edit(tensors)`` applied to its weights."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---------------------------------------------------------------- ModelInfo


def test_model_info_from_transformers5_config(tiny):
    info = ModelInfo.from_dir(tiny)
    assert (info.architecture, info.model_type) == ("LlamaForCausalLM", "llama")
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert (info.hidden_size, info.intermediate_size, info.vocab_size) == (64, 128, 256)
    assert info.rope_theta == 10000.0 and info.rope_scaling is None
    assert info.tie_word_embeddings and not info.attention_bias and not info.qk_norm
    assert info.sliding_window is None and info.layer_sliding_windows == (None, None)
    assert info.dtype == torch.float32 and info.eos_token_ids == (2,) and info.bos_token_id == 1
    assert info.quantization_config is None


def test_model_info_legacy_keys_and_generation_config(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
           "num_attention_heads": 8, "num_hidden_layers": 3, "intermediate_size": 256, "vocab_size": 1000,
           "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0},
           "torch_dtype": "bfloat16", "eos_token_id": 2, "bos_token_id": None,
           "quantization_config": {"quant_method": "awq", "bits": 4}}
    info = ModelInfo.from_dir(_write_config(tmp_path, cfg, {"eos_token_id": [7, 2], "bos_token_id": 1}))
    assert info.num_kv_heads == 8 and info.head_dim == 16  # defaults: MHA, hidden / heads
    assert info.rope_theta == 500000.0 and info.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert info.dtype == torch.bfloat16 and info.eos_token_ids == (2, 7) and info.bos_token_id == 1
    assert info.quantization_config == {"quant_method": "awq", "bits": 4}
    assert not info.tie_word_embeddings


def test_model_info_llama3_rope_parameters(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    path = make_tiny_checkpoint(tmp_path / "l3", "LlamaForCausalLM", rope_parameters=rope)
    info = ModelInfo.from_dir(path)
    assert info.rope_theta == 500000.0
    assert info.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


@pytest.mark.parametrize(
    ("arch", "overrides", "expect"),
    [
        ("Qwen2ForCausalLM", {}, dict(attention_bias=True, o_proj_bias=False, qk_norm=False, sliding_window=None)),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
         dict(sliding_window=8, layer_sliding_windows=(None, 8))),
        ("Qwen3ForCausalLM", {}, dict(attention_bias=False, qk_norm=True, head_dim=16)),
        ("Qwen3ForCausalLM", {"attention_bias": True}, dict(attention_bias=True, o_proj_bias=True)),
        ("MistralForCausalLM", {"sliding_window": None}, dict(sliding_window=None, attention_bias=False)),
        ("MistralForCausalLM", {"sliding_window": 32}, dict(sliding_window=32, layer_sliding_windows=(32, 32))),
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True},
         dict(attention_bias=True, o_proj_bias=True, mlp_bias=True)),
    ],
)
def test_model_info_architecture_flags(tmp_path, arch, overrides, expect):
    config_cls, _ = hf_classes(arch)
    cfg = config_cls(**{**TINY, **overrides}).to_dict()
    cfg["architectures"] = [arch]
    info = ModelInfo.from_dir(_write_config(tmp_path, cfg))
    assert {k: getattr(info, k) for k in expect} == expect


def test_model_info_qwen2_window_ignored_unless_enabled(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
           "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 0}
    assert ModelInfo.from_dir(_write_config(tmp_path, cfg)).sliding_window is None


def test_model_info_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelInfo.from_dir(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ValueError, match=r"bad/config.json: malformed JSON"):
        ModelInfo.from_dir(bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelInfo.from_dir(bad)
    gpt2 = _write_config(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"gpt2/config.json: unsupported architecture 'GPT2LMHeadModel'"):
        ModelInfo.from_dir(gpt2)
    nokey = _write_config(tmp_path / "nokey", {"architectures": ["LlamaForCausalLM"], "hidden_size": 64})
    with pytest.raises(ValueError, match="missing required key 'num_attention_heads'"):
        ModelInfo.from_dir(nokey)
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 8, "vocab_size": 8}
    longrope = _write_config(tmp_path / "longrope", {**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        ModelInfo.from_dir(longrope)
    yarn = _write_config(tmp_path / "yarn", {**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="yarn rope scaling needs original_max_position_embeddings"):
        ModelInfo.from_dir(yarn)


# ---------------------------------------------------------------- loader


def test_loaded_model_is_materialised_tied_and_hooked(tiny):
    model = _load(tiny)
    info = model.info
    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params  # tied: one tensor, named once
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in params.items():
        assert p.device == CPU and p.dtype == torch.float32 and not p.requires_grad, name
        assert callable(getattr(p, "weight_loader", None)), name
    for name, b in model.named_buffers():
        assert b.device == CPU and not b.is_meta, name
    want = rope_cos_sin_cache(rope_inv_freq(info.head_dim, info.rope_theta), info.max_position_embeddings)
    assert torch.equal(model.model.rotary_emb.cos_sin_cache, want)
    attn = model.model.layers[1].self_attn
    assert attn.rotary_emb is model.model.rotary_emb  # one table for all layers
    assert attn.k_scale.item() == 1.0 and attn.v_scale.item() == 1.0 and attn.k_scale.dtype == torch.float32
    hf = load_file(tiny / "model.safetensors")
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    gate_up = torch.cat([hf[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, gate_up)


def test_bf16_load_casts_each_tensor(tiny):
    model = _load(tiny, torch.bfloat16)
    hf = load_file(tiny / "model.safetensors")
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, hf["model.norm.weight"].to(torch.bfloat16))
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_sharded_index_loads_every_shard(tiny_untied):
    assert (tiny_untied / "model.safetensors.index.json").is_file()
    assert len(list(tiny_untied.glob("*.safetensors"))) > 2
    model = _load(tiny_untied)
    index = json.loads((tiny_untied / "model.safetensors.index.json").read_text())["weight_map"]
    head = load_file(tiny_untied / index["lm_head.weight"])["lm_head.weight"]
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, head)


def test_index_naming_a_missing_shard(tiny_untied, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(tiny_untied, dst)
    victim = sorted(dst.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        _load(dst)


def test_missing_tensor_is_named(tiny, tmp_path):
    dst = _edited_copy(tiny, tmp_path / "ck", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight") as e:
        _load(dst)
    assert str(dst) in str(e.value) and "model.safetensors" in str(e.value)


def test_untied_checkpoint_without_lm_head_fails(tiny_untied, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(tiny_untied, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / index["lm_head.weight"]
    tensors = load_file(shard)
    tensors.pop("lm_head.weight")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor.*lm_head\.weight"):
        _load(dst)


def test_shape_mismatch_is_named(tiny, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)

    dst = _edited_copy(tiny, tmp_path / "ck", edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(100, 64\).*\(128, 64\)") as e:
        _load(dst)
    assert str(dst / "model.safetensors") in str(e.value)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)

    dst = _edited_copy(tiny, tmp_path / "ck", edit)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'") as e:
        _load(dst)
    assert "model.safetensors" in str(e.value)


def test_kv_scales_and_legacy_rotary_buffers(tiny, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
        t["model.layers.0.self_attn.v_scale"] = torch.tensor([0.75])
        t["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.25)
        t["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints carry it

    model = _load(_edited_copy(tiny, tmp_path / "ck", edit))
    a0, a1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert (a0.k_scale.item(), a0.v_scale.item(), a1.k_scale.item(), a1.v_scale.item()) == (0.5, 0.75, 0.25, 0.25)
    assert a0.k_scale.dtype == torch.float32 and a0.k_scale.shape == ()


def test_no_safetensors_and_bad_format(tiny, tmp_path):
    dst = tmp_path / "ck"
    dst.mkdir()
    shutil.copy(tiny / "config.json", dst / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*ck"):
        _load(dst)
    with pytest.raises(ValueError, match="unsupported load_format 'pt'"):
        _load(tiny, load_format="pt")


def test_dummy_format_needs_only_config(tiny, tmp_path):
    dst = tmp_path / "ck"
    dst.mkdir()
    shutil.copy(tiny / "config.json", dst / "config.json")
    a, b = _load(dst, load_format="dummy"), _load(dst, load_format="dummy")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name  # seeded
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert 0.015 < pa.std().item() < 0.025, name
    qkv = a.model.layers[0].self_attn.qkv_proj.weight
    assert not torch.equal(qkv, a.model.layers[1].self_attn.qkv_proj.weight)  # not one tensor repeated
    info = a.info
    cache = PagedCache(info.num_layers, info.num_kv_heads, info.head_dim, torch.float32)
    table = cache.blocks_for([], 5)
    meta, pos = make_meta([(0, 5, table)], cache.block_size)
    with torch.no_grad():
        logits = a.compute_logits(a(torch.arange(5), pos, cache.kv_caches, meta))
    assert logits.shape == (5, 256) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_resolve_dtype(tmp_path, tiny):
    info32 = ModelInfo.from_dir(tiny)
    assert resolve_dtype("auto", info32, CPU) == torch.float32
    cfg = json.loads((tiny / "config.json").read_text())
    for name, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        info = ModelInfo.from_dir(_write_config(tmp_path / name, {**cfg, "dtype": name}))
        assert resolve_dtype("auto", info, CPU) == want  # half checkpoints stay half on the CPU too
        assert resolve_dtype("float32", info, CPU) == torch.float32
    nodtype = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}
    assert resolve_dtype("auto", ModelInfo.from_dir(_write_config(tmp_path / "nd", nodtype)), CPU) == torch.float32
    assert resolve_dtype("bfloat16", info32, CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", info32, CPU)
