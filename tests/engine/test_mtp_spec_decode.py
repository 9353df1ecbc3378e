"""Speculative decoding with the checkpoint's multi-token-prediction layers ({"method": "mtp"}) on tiny random
DeepSeek-V3 (latent attention) and GLM-4.5 (grouped-query attention) checkpoints whose MTP layer the test writes
(transformers saves none): the MTP head's logits equal the formula computed from the checkpoint's tensors
(transformers running the layer's decoder block), so do the engine's drafts after every step, greedy output
equals greedy output without speculation whatever the batching, chunking, swap preemption, forks or prefix hits,
an MTP layer built to predict well gets its drafts accepted, aborts leak no block, and the MTP layer's cache
counts in the KV budget; on the Triton attention backend (the GPU, or the interpreter on CPU) every MTP pass's
logits are the torch backend's; over 2 tensor-parallel ranks (gloo) the tokens, drafts and acceptance are the single
process's and every rank's blocks are accounted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from family_fixtures import PROMPTS, greedy_tokens, scale_routers, tiny_llm
from model_fixtures import hf_model, make_meta, make_tiny_checkpoint
from safetensors.torch import load_file, save_file
from smollm2 import assert_no_leak

from paged_backend import SamplingParams

pytestmark = pytest.mark.slow

YARN = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1,
            original_max_position_embeddings=128, rope_theta=10000.0)
FAMILIES = {
    # DeepSeek-V3: latent attention with a low-rank q, sigmoid noaux_tc routing, a dense first layer
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
        intermediate_size=96, rope_parameters=YARN, q_lora_rank=24, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    # GLM-4.5: grouped-query attention with q/k norm and bias, partial rotary, shared experts
    "glm4_moe": ("Glm4MoeForCausalLM", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True)),
}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BLOCK_TENSORS = (".self_attn.", ".mlp.", ".input_layernorm.", ".post_attention_layernorm.")


def write_mtp_layer(path: Path, edit=None) -> None:
    """MTP layer ``L`` as DeepSeek-V3 / GLM-4.5 checkpoints store it: layer L - 1's decoder block perturbed,
    random enorm / hnorm / eh_proj / shared_head, and an embedding (zeros here: the engine uses the model's, as
    vLLM does, so the formula test shows that this one is never read);
    ``edit(tensors, L)`` may rewrite the result. Sets num_nextn_predict_layers: 1."""
    cfg = json.loads((path / "config.json").read_text())
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."

    def noise(t: torch.Tensor, scale: float) -> torch.Tensor:
        return t + scale * torch.randn(t.shape, generator=gen)

    out = {mtp + n.removeprefix(last): noise(t, 0.05) for n, t in tensors.items() if n.startswith(last)}
    out[mtp + "enorm.weight"] = noise(torch.ones(hidden), 0.2)
    out[mtp + "hnorm.weight"] = noise(torch.ones(hidden), 0.2)
    out[mtp + "eh_proj.weight"] = noise(torch.zeros(hidden, 2 * hidden), 0.1)
    out[mtp + "shared_head.norm.weight"] = noise(torch.ones(hidden), 0.2)
    out[mtp + "shared_head.head.weight"] = noise(tensors["lm_head.weight"], 0.05)
    out[mtp + "embed_tokens.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    tensors.update(out)
    if edit is not None:
        edit(tensors, layers)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))


def make_mtp_checkpoint(root: Path, family: str, edit=None, **overrides) -> Path:
    arch, kw = FAMILIES[family]
    path = make_tiny_checkpoint(root / family, arch, **{**kw, **overrides})
    scale_routers(path)  # before the MTP layer copies a routed layer
    write_mtp_layer(path, edit)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """The checkpoint and its greedy tokens without speculation (batched: the family tests show every
    schedule gives transformers' tokens)."""
    path = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), request.param)
    return path, greedy_tokens(tiny_llm(path))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class MTPReference:
    """The MTP formula from the checkpoint's tensors: h_i transformers' last hidden state before the final norm
    (a hook on it), enorm / hnorm / eh_proj in plain torch, the layer's decoder block run by transformers as a
    one-layer model whose final norm and head are the shared head's."""

    @torch.no_grad()
    def __init__(self, path: Path, tmp: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        self.eps, L = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
        tensors = load_file(path / "model.safetensors")
        mtp = f"model.layers.{L}."
        self.embed = tensors["model.embed_tokens.weight"]
        self.enorm, self.hnorm = tensors[mtp + "enorm.weight"], tensors[mtp + "hnorm.weight"]
        self.eh_proj = tensors[mtp + "eh_proj.weight"]
        block = {"model.layers.0." + n.removeprefix(mtp): t for n, t in tensors.items()
                 if n.startswith(mtp) and any(s in n for s in BLOCK_TENSORS)}
        block["model.norm.weight"] = tensors[mtp + "shared_head.norm.weight"]
        block["lm_head.weight"] = tensors.get(mtp + "shared_head.head.weight", tensors["lm_head.weight"])
        block["model.embed_tokens.weight"] = self.embed
        dst = tmp / "mtp-block"
        dst.mkdir()
        save_file(block, dst / "model.safetensors", metadata={"format": "pt"})
        one = {**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}
        (dst / "config.json").write_text(json.dumps(one))
        self.model, self.block = hf_model(path), hf_model(dst)

    @staticmethod
    def _prenorm(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states before the final norm, logits) of one sequence."""
        captured = []
        hook = model.model.norm.register_forward_hook(lambda m, args, out: captured.append(args[0][0]))
        logits = model(**inputs).logits[0]
        hook.remove()
        return captured[0], logits

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self._prenorm(self.model, input_ids=torch.tensor([tokens]))[0]

    @torch.no_grad()
    def layer(self, next_tokens: list[int], prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, logits) of the MTP layer at positions 0.. given t_{i+1} and h_i per position."""
        e = self.embed[torch.tensor(next_tokens)]
        e[0] = 0.0  # position 0
        x = torch.cat([_rms(e, self.enorm, self.eps), _rms(prev, self.hnorm, self.eps)], -1) @ self.eh_proj.T
        return self._prenorm(self.block, inputs_embeds=x[None])

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after ``tokens`` (the target computed all but the last): the layer over every
        position, then again with each draft and the layer's own last hidden state."""
        nexts, prev = list(tokens[1:]), self.target_hidden(tokens[:-1])
        out: list[int] = []
        for _ in range(k):
            hidden, logits = self.layer(nexts, prev)
            out.append(int(logits[-1].argmax()))
            nexts.append(out[-1])
            prev = torch.cat([prev, hidden[-1:]])
        return out


@torch.no_grad()
def test_mtp_logits_equal_the_formula_on_the_checkpoint_tensors(family, tmp_path) -> None:
    """Per position i: shared_head.head(shared_head.norm(block(eh_proj([enorm(embed(t_{i+1})) (zero at
    position 0) | hnorm(h_i)])))) (``MTPReference``), against the engine's model over its paged caches, one
    prefill."""
    path, _ = family
    seq = PROMPTS[3][:17]  # t_0 .. t_16: the target runs t_0 .. t_15, the MTP layer t_1 .. t_16
    n = len(seq) - 1
    ref = MTPReference(path, tmp_path)
    h = ref.target_hidden(seq[:n])
    want = ref.layer(seq[1:], h)[1]

    llm = tiny_llm(path, speculative_config=MTP)
    runner = llm.engine.runner
    model, L = runner.model, llm.engine.info.num_layers
    assert model.mtp is not None and len(runner.kv_caches) == L + 1
    assert not torch.equal(model.mtp.layers[0].shared_head.head.weight, model.lm_head.weight)  # its own head
    table = [3, 5]  # any blocks: the engine holds no request
    meta, pos = make_meta([(0, n, table)], runner.block_size)
    model(torch.tensor(seq[:n]), pos, runner.kv_caches, meta)
    prev = runner.last_hidden_states()
    assert torch.allclose(prev, h, atol=1e-5)
    got = model.mtp.compute_logits(model.mtp(torch.tensor(seq[1:]), pos, prev, runner.kv_caches[L:], meta))
    assert got.shape == want.shape == (n, llm.engine.info.vocab_size)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_engine_drafts_are_the_formula_drafts_step_after_step(family, tmp_path) -> None:
    """Prompts prefilled in chunks of 16 beside each other, then verification steps that keep some drafts and
    roll the others back: after every step each decoding request's 2 drafts are ``MTPReference.drafts`` of its
    tokens (the MTP cache holds exactly the positions the target kept, the second draft reads the first's
    hidden state one position on)."""
    path, _ = family
    _check_formula_drafts_step_after_step(tiny_llm(path, speculative_config=MTP, max_num_batched_tokens=16).engine,
                                          MTPReference(path, tmp_path))


def _check_formula_drafts_step_after_step(engine, ref: MTPReference) -> list[tuple[list, torch.Tensor]]:
    """Prompts 2 and 3 to 8 tokens on ``engine`` (MTP, two drafts): after every step each decoding request's
    drafts are ``ref.drafts`` of its tokens; every block is back. Returns each MTP pass's (spans, logits)."""
    passes = []
    execute_mtp = engine.runner.execute_mtp

    def record(sched, rows, spec_step=0):
        logits = execute_mtp(sched, rows, spec_step)
        spans = [(s.request_id, s.start_pos, s.token_ids) for s in sched.scheduled]
        passes.append(((spans, list(rows), spec_step), logits.cpu()))
        return logits

    engine.runner.execute_mtp = record
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in (2, 3):
        engine.add_request(f"r{i}", PROMPTS[i], params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            if len(req.spec_token_ids) == 2:
                assert req.spec_token_ids == ref.drafts(req.all_token_ids, 2), (req.request_id, checked)
                checked += 1
    assert checked >= 4 and engine.spec.stats.num_drafts >= 4
    assert_no_leak(engine)
    del engine.runner.execute_mtp
    return passes


def test_disable_by_batch_size_drafts_resume_with_the_formula_drafts(family, tmp_path) -> None:
    """Speculation off above two requests: while three are held no request drafts (each step's MTP pass still
    covers its positions); once the short one finishes, the others' drafts are ``MTPReference.drafts`` of their
    tokens (the MTP cache holds the positions decoded without drafts) and the tokens are the plain engine's."""
    path, expected = family
    engine = tiny_llm(path, speculative_config={**MTP, "disable_by_batch_size": 2}).engine
    ref = MTPReference(path, tmp_path)
    lengths = (10, 10, 3)
    for i, n in enumerate(lengths):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    tokens: list[list[int]] = [[] for _ in lengths]
    checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id)] += out.outputs[0].token_ids
        held = engine.scheduler.num_requests > 2
        for req in engine.scheduler.running:
            assert not (held and req.spec_token_ids)
            if len(req.spec_token_ids) == 2:
                assert req.spec_token_ids == ref.drafts(req.all_token_ids, 2), req.request_id
                checked += 1
    assert tokens == [e[:n] for e, n in zip(expected, lengths, strict=False)]
    assert checked >= 2 and engine.spec.stats.num_disabled_steps > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}, {"async_scheduling": True},
                                {"max_num_batched_tokens": 16, "async_scheduling": True}],
                         ids=["batched", "chunked", "async", "async-chunked"])
def test_greedy_with_mtp_drafts_equals_greedy_without(family, kw) -> None:
    """Two drafts a step (the one MTP layer reused for the second), prompts prefilled whole or in chunks of 16
    beside verification steps, synchronously or under async scheduling (a step's MTP pass then runs after the
    next step's forward, on the hidden states its own forward kept): the tokens are the plain engine's, the
    drafts were verified, every block is back."""
    path, expected = family
    llm = tiny_llm(path, speculative_config=MTP, **kw)
    assert greedy_tokens(llm) == expected
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts  # second drafts made too
    assert stats.num_accepted_tokens == sum(stats.accepted_per_pos) <= stats.num_draft_tokens
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_swap_preemption_forks_and_prefix_hits_keep_the_tokens(family, async_) -> None:
    """A cache of 7 usable blocks preempts by swap (the MTP layer's blocks go to the host tier and back with the
    others; under async scheduling a request whose verification is in flight is recomputed instead), two greedy
    samples of each prompt fork, a second pass hits the prefix cache: the plain engine's tokens."""
    path, expected = family
    llm = tiny_llm(path, speculative_config=MTP, kv_cache_memory_bytes=None, num_gpu_blocks_override=8,
                   preemption_mode="swap", swap_space=0.01, async_scheduling=async_)
    assert llm.engine.runner.host_caches and len(llm.engine.runner.host_caches) == len(llm.engine.runner.kv_caches)
    assert greedy_tokens(llm) == expected
    assert llm.engine.stats.num_preemptions_total > 0 and llm.engine.spec.stats.num_drafts > 0
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2),
                        use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert_no_leak(llm.engine)


def test_the_mtp_cache_counts_in_the_kv_budget(family) -> None:
    """The MTP layer is one more cache layer on the same block ids: bytes per block grow by (L + 1) / L and a
    fixed budget holds that many fewer blocks."""
    path, _ = family
    plain, spec = tiny_llm(path).engine, tiny_llm(path, speculative_config=MTP).engine
    L = plain.info.num_layers
    assert spec.runner.bytes_per_block * L == plain.runner.bytes_per_block * (L + 1)
    budget = 4 << 20  # tiny_llm's kv_cache_memory_bytes
    assert (plain.runner.num_blocks, spec.runner.num_blocks) == (budget // plain.runner.bytes_per_block,
                                                                 budget // spec.runner.bytes_per_block)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_an_abort_in_the_middle_of_speculative_steps_leaks_nothing(family, async_) -> None:
    path, _ = family
    engine = tiny_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                      async_scheduling=async_).engine
    assert _abort_between_speculative_steps(engine) >= 1 and engine.spec.stats.num_drafts > 0
    assert_no_leak(engine)


def _abort_between_speculative_steps(engine, check=lambda engine: None) -> int:
    """Runs the prompts, aborting a request each time after it drafted and had a verification step (``check``
    after each step and abort); the number aborted."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    aborted = 0
    while engine.has_unfinished_requests():
        engine.step()
        check(engine)
        drafted = [r.request_id for r in engine.scheduler.running if r.spec_token_ids]
        if drafted:
            engine.step()  # a verification step, then drafts again
            if engine.abort_request(drafted[0]) is not None:
                aborted += 1
                check(engine)
    return aborted


def _predictive(tensors: dict[str, torch.Tensor], L: int) -> None:
    """A one-layer model whose attention barely matters (o_proj scaled down) and whose embedding rows have unit
    RMS; its MTP layer the same decoder block on enorm(embed(t_{i+1})) alone (eh_proj = [I | 0], unit norms) and
    the model's final norm and head: it predicts t_{i+2} as the model does from t_{i+1}."""
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    emb = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True))
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        if name.endswith("o_proj.weight"):
            tensors[name] = tensors[name] * 0.01
        tensors[name.replace("model.layers.0.", f"model.layers.{L}.")] = tensors[name].clone()
    mtp = f"model.layers.{L}."
    tensors[mtp + "enorm.weight"] = torch.ones(hidden)
    tensors[mtp + "hnorm.weight"] = torch.ones(hidden)
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_mtp_layer_that_predicts_well_gets_its_drafts_accepted(name, tmp_path) -> None:
    path = make_mtp_checkpoint(tmp_path, name, _predictive, num_hidden_layers=1, first_k_dense_replace=0)
    expected = greedy_tokens(tiny_llm(path))
    llm = tiny_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert greedy_tokens(llm) == expected
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens >= stats.num_draft_tokens // 2, stats
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[1] >= stats.accepted_per_pos[2] > 0
    assert llm.engine.stats.num_steps < len(PROMPTS) * GREEDY.max_tokens // 2  # several tokens a step
    assert_no_leak(llm.engine)
    # under async scheduling: the same tokens, drafts and acceptances (each request drafts after each of its
    # steps either way)
    asyn = tiny_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, async_scheduling=True)
    assert greedy_tokens(asyn) == expected
    a = asyn.engine.spec.stats
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.accepted_per_pos) == (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_pos)
    assert asyn.engine.num_async_steps > 0
    assert_no_leak(asyn.engine)


def test_an_mtp_layer_stored_without_its_head_uses_the_model_head(tmp_path) -> None:
    """GLM-4.6 stores no shared_head.head: the layer shares the model's LM head (no second copy), and its
    drafts are the formula's with that head."""
    def drop_head(tensors: dict[str, torch.Tensor], L: int) -> None:
        del tensors[f"model.layers.{L}.shared_head.head.weight"]

    path = make_mtp_checkpoint(tmp_path, "glm4_moe", drop_head)
    engine = tiny_llm(path, speculative_config=MTP).engine
    model = engine.runner.model
    assert model.mtp.layers[0].shared_head.head is model.lm_head
    assert [n for n, _ in model.named_parameters() if n.endswith("head.weight")] == ["lm_head.weight"]
    ref = MTPReference(path, tmp_path)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    req = engine.scheduler.running[0]
    assert req.spec_token_ids == ref.drafts(req.all_token_ids, 2)


def test_mtp_needs_a_checkpoint_with_mtp_layers(tmp_path) -> None:
    """A checkpoint without MTP layers (num_nextn_predict_layers 0) is refused by name; one whose config.json
    counts a layer its tensors lack fails at load naming them; without method mtp the MTP layer is not loaded
    (no parameter, no cache layer)."""
    arch, kw = FAMILIES["glm4_moe"]
    path = make_tiny_checkpoint(tmp_path / "plain", arch, **kw, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"method 'mtp' needs .*num_nextn_predict_layers > 0"):
        tiny_llm(path, speculative_config=MTP)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \[.*'model\.layers\.2\.eh_proj\.weight'"):
        tiny_llm(path, speculative_config=MTP)
    path = make_mtp_checkpoint(tmp_path, "glm4_moe")
    engine = tiny_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2}).engine
    assert getattr(engine.runner.model, "mtp", None) is None and len(engine.runner.kv_caches) == 2
    assert not any(n.startswith("mtp.") for n, _ in engine.runner.model.named_parameters())


# DeepSeek-V3 with a rotary part the latent-attention Triton kernel takes (its dims powers of two >= 16; the
# family's 8 runs the torch reference on the Triton backend)
TRITON_DIMS = {"deepseek_v3": dict(qk_rope_head_dim=16, head_dim=16), "glm4_moe": {}}


def _check_triton_path(name: str, tmp_path: Path, atol: float, quick: bool = False, **kw) -> None:
    """The Triton attention backend, prefills in chunks of 16: the drafts after every step are the formula's and
    every MTP pass's logits the torch backend's (within ``atol``), the tokens with two MTP drafts a step are those
    without speculation, and an MTP layer built to predict well gets the torch path's drafts and acceptances (a
    random one gets none accepted on either path). ``quick``: two prompts to 8 tokens, no run without speculation.
    ``kw``: the engine's arguments (device, dtype, ...)."""
    from paged_backend import LLM

    def llm(path: Path, **more) -> LLM:
        out = LLM(model=str(path), skip_tokenizer_init=True, log_stats_interval=0, seed=0,
                  attention_backend="triton", max_num_batched_tokens=16, **kw, **more)
        runner = out.engine.runner
        # on CUDA the target's forward replays CUDA graphs (the MTP passes stay eager); the CPU has none
        assert runner.attn_backend.name == "triton" and (runner.graphs is not None) == (runner.device.type == "cuda")
        return out

    def tokens(llm: LLM) -> list[list[int]]:
        if not quick:
            return greedy_tokens(llm)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[2:], params, use_tqdm=False)]

    path = make_mtp_checkpoint(tmp_path / "random", name, **TRITON_DIMS[name])
    ref = MTPReference(path, tmp_path)
    want = _check_formula_drafts_step_after_step(
        tiny_llm(path, speculative_config=MTP, max_num_batched_tokens=16, attention_backend="torch").engine, ref)
    spec = llm(path, speculative_config=MTP)
    try:
        # the same passes as the torch path's, each with its logits (a position or cache slot off shows here
        # before it flips a draft)
        got = _check_formula_drafts_step_after_step(spec.engine, ref)
        assert [g[0] for g in got] == [w[0] for w in want]
        for i, ((_, g), (_, w)) in enumerate(zip(got, want, strict=True)):
            assert torch.allclose(g, w, atol=atol, rtol=atol), (i, (g - w).abs().max())
        if not quick:
            plain = llm(path)
            expected = greedy_tokens(plain)
            plain.engine.shutdown()
            assert greedy_tokens(spec) == expected
            assert_no_leak(spec.engine)
    finally:
        spec.engine.shutdown()
    # the random layer's drafts are rejected on either path: acceptance with a layer that predicts well
    path = make_mtp_checkpoint(tmp_path / "predictive", name, _predictive, num_hidden_layers=1,
                               first_k_dense_replace=0, **TRITON_DIMS[name])
    torch_path = tiny_llm(path, speculative_config=MTP, max_num_batched_tokens=16, attention_backend="torch")
    expected = tokens(torch_path)
    spec = llm(path, speculative_config=MTP)
    try:
        assert tokens(spec) == expected
        stats, want = spec.engine.spec.stats, torch_path.engine.spec.stats
        assert stats.num_accepted_tokens >= stats.num_draft_tokens // 2 > 0, stats
        assert (stats.num_drafts, stats.num_draft_tokens, stats.accepted_per_pos) == (
            want.num_drafts, want.num_draft_tokens, want.accepted_per_pos)
        assert_no_leak(spec.engine)
    finally:
        spec.engine.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cuda_triton_greedy_with_mtp_drafts_equals_greedy_without(name, tmp_path) -> None:
    """On the GPU in fp32 (Triton kernels; the latent-attention kernel for DeepSeek): ``_check_triton_path``."""
    _check_triton_path(name, tmp_path, 1e-3, dtype="float32", device="cuda", kv_cache_memory_bytes=16 << 20)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_interpreted_triton_path_drafts_are_the_formula_drafts(name, tmp_path) -> None:
    """``_check_triton_path`` (quick) on CPU tensors under the Triton interpreter (the attention kernels; the
    model's other ops the torch references)."""
    _check_triton_path(name, tmp_path, 1e-4, quick=True, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20)


def _rank_blocks_match(engine) -> None:
    """Every rank's cache holds exactly the blocks rank 0's manager has handed to the running requests."""
    used = engine.kv.block_pool.num_total_usable - engine.kv.num_free_blocks
    reports = engine.runner.rank_reports([r.request_id for r in engine.scheduler.running])
    assert [r.rank for r in reports] == [0, 1]
    for r in reports:
        assert r.num_blocks == engine.runner.num_blocks and r.num_used_blocks == used, (r, used)


def test_tensor_parallel_2_greedy_with_mtp_drafts_equals_greedy_without(family) -> None:
    """Over 2 ranks (gloo) every MTP pass runs on both ranks, each on its own hidden states, its layer split as
    the model's: the tokens are the plain engine's, the drafts and their acceptance TP = 1's; an abort between
    speculative steps leaks no block on any rank."""
    path, expected = family
    tp1 = tiny_llm(path, speculative_config=MTP)
    assert greedy_tokens(tp1) == expected
    llm = tiny_llm(path, speculative_config=MTP, tensor_parallel_size=2)
    engine = llm.engine
    try:
        assert len(engine.runner.worker_pids) == 1
        assert greedy_tokens(llm) == expected
        got, ref = engine.spec.stats, tp1.engine.spec.stats
        assert got.num_draft_tokens > got.num_drafts > 0
        assert (got.num_drafts, got.num_draft_tokens, got.accepted_per_pos) == (
            ref.num_drafts, ref.num_draft_tokens, ref.accepted_per_pos)
        assert_no_leak(engine)

        assert _abort_between_speculative_steps(engine, _rank_blocks_match) >= 1
        assert_no_leak(engine)
        for r in engine.runner.rank_reports([]):
            assert r.num_used_blocks == 0 and r.num_free_blocks == engine.runner.num_blocks - 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("name", "ep"), [("deepseek_v3", False), ("glm4_moe", False), ("glm4_moe", True)],
                         ids=["deepseek_v3", "glm4_moe", "glm4_moe-expert-parallel"])
def test_tensor_parallel_2_mtp_layer_that_predicts_well_gets_its_drafts_accepted(name, ep, tmp_path) -> None:
    """At TP = 2 (and with whole routed experts per rank: the MTP layer's too) the predictive layer's drafts are
    accepted and the tokens are the plain engine's."""
    path = make_mtp_checkpoint(tmp_path, name, _predictive, num_hidden_layers=1, first_k_dense_replace=0)
    expected = greedy_tokens(tiny_llm(path))
    llm = tiny_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, tensor_parallel_size=2,
                   enable_expert_parallel=ep)
    try:
        experts = llm.engine.runner.local.model.mtp.layers[0].mlp.experts
        assert experts.num_local_experts == (experts.num_experts // 2 if ep else experts.num_experts)
        assert greedy_tokens(llm) == expected
        stats = llm.engine.spec.stats
        assert stats.num_accepted_tokens >= stats.num_draft_tokens // 2, stats
        assert stats.accepted_per_pos[2] > 0
        assert llm.engine.stats.num_steps < len(PROMPTS) * GREEDY.max_tokens // 2
        assert_no_leak(llm.engine)
    finally:
        llm.engine.shutdown()
