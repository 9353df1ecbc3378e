"""int4 mixture-of-experts checkpoints end to end on the CPU: tiny random Qwen3-MoE, Mixtral and GLM-4.5 MoE
models (transformers' own save_pretrained) whose decoder linears, routed experts included, this test quantizes
to int4 in the two formats the int4 MoE releases ship (``quant_fixtures.write_int4_moe_checkpoint``): GPTQ
(GPTQModel's layout, v1 zero points, no act-order: Qwen3-30B-A3B-GPTQ-Int4) and AWQ (AutoAWQ GEMM), groups of
64 inputs with their own zero points and fp16 scales.

The dequantized weights are exact float32 numbers ((q - z) * s), and the engine computes the same ones, so
the expected tokens are transformers' own greedy tokens on the dequantized checkpoint, token for token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from family_fixtures import (
    SCHEDULES,
    check_cuda_triton_greedy,
    check_greedy_equals_transformers,
    check_prefix_cache_and_preemption,
    check_tensor_parallel_2,
    hf_greedy,
    make_quant_moe_families,
    rewrite_checkpoint,
    tiny_llm,
)
from quant_fixtures import int4_moe_quant_config, quantize_int4_weight, write_int4_moe_checkpoint
from safetensors.torch import load_file

from paged_backend.attention.torch_attn import TorchAttentionBackend
from paged_backend.distributed import TPGroup
from paged_backend.kernels.int4_gemm_ref import unpack_int4_kernel
from paged_backend.models.model_info import ModelInfo
from paged_backend.models.moe import FusedMoE
from paged_backend.worker.model_loader import load_model

pytestmark = pytest.mark.slow

GROUP = 64
CASES = [("qwen3_moe", "gptq"), ("mixtral", "awq"), ("glm4_moe", "awq"), ("glm4_moe", "gptq")]


@pytest.fixture(scope="module")
def dense_families(tmp_path_factory) -> dict[str, Path]:
    return make_quant_moe_families(tmp_path_factory)


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{q}" for f, q in CASES])
def int4_family(request, dense_families, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    family, fmt = request.param
    root = tmp_path_factory.mktemp(f"{family}-{fmt}")
    write_int4_moe_checkpoint(dense_families[family], root / "int4", root / "dequantized", fmt, GROUP)
    return root / "int4", hf_greedy(root / "dequantized")


def _experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _load(path: Path, tp: TPGroup | None = None):
    return load_model(path, ModelInfo.from_dir(path), torch.float32, "cpu", TorchAttentionBackend(), tp=tp)


def test_experts_are_repacked_into_the_kernel_layout(int4_family, dense_families) -> None:
    """w13 / w2 hold every expert's codes in the int4 kernel layout (gate features then up), beside its
    group scales and zero points: the numbers the quantizer wrote."""
    path, _ = int4_family
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
    model = _load(path)
    layer, experts = next((i, m.mlp.experts) for i, m in enumerate(model.model.layers)
                          if isinstance(getattr(m.mlp, "experts", None), FusedMoE))
    mixtral = model.info.model_type == "mixtral"
    prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}.experts.5"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    assert experts.quant_method.fmt == fmt
    assert experts.w13.dtype == experts.w2.dtype == torch.int32
    assert experts.w13.shape == (8, 512, 32) and experts.w2.shape == (8, 256, 32)
    assert experts.w13_scale.shape == experts.w13_zeros.shape == (8, 4, 512)
    assert experts.w2_scale.shape == experts.w2_zeros.shape == (8, 4, 256)
    dense = load_file(dense_families[model.info.model_type] / "model.safetensors")
    parts = [quantize_int4_weight(dense[f"{prefix}.{p}.weight"], GROUP) for p in (gate, up)]
    assert torch.equal(unpack_int4_kernel(experts.w13[5]), torch.cat([parts[0][0], parts[1][0]], 1).to(torch.uint8))
    assert torch.equal(experts.w13_zeros[5], torch.cat([parts[0][1], parts[1][1]], 1).to(torch.uint8))
    assert torch.equal(experts.w13_scale[5].float(), torch.cat([parts[0][2], parts[1][2]], 1).float())
    codes, zeros, scales, _ = quantize_int4_weight(dense[f"{prefix}.{down}.weight"], GROUP)
    assert torch.equal(unpack_int4_kernel(experts.w2[5]), codes.to(torch.uint8))
    assert torch.equal(experts.w2_zeros[5], zeros.to(torch.uint8)) and torch.equal(experts.w2_scale[5].float(),
                                                                                   scales.float())


@pytest.mark.parametrize("kw", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_greedy_equals_transformers_on_the_dequantized_weights(int4_family, kw) -> None:
    check_greedy_equals_transformers(*int4_family, **kw)


def test_prefix_cache_and_preemption_keep_the_tokens(int4_family) -> None:
    check_prefix_cache_and_preemption(*int4_family)


def test_tensor_parallel_2_equals_1(int4_family) -> None:
    """Each of 2 ranks holds half of every expert's intermediate features (two of down's four groups)."""
    check_tensor_parallel_2(*int4_family)


def test_expert_parallel_2_equals_1(int4_family) -> None:
    """Whole experts per rank (4 of the 8 each, their scales and zero points with them): the same tokens."""
    llm = check_tensor_parallel_2(*int4_family, enable_expert_parallel=True)
    experts = _experts(llm.engine.runner.local.model)
    assert experts
    for e in experts:
        assert e.w13.dtype == torch.int32 and e.w13.shape[0] == e.w2.shape[0] == 4
        assert e.w13_scale.shape[0] == e.w2_zeros.shape[0] == 4


# -- bad checkpoints and refused formats -------------------------------------------------------------------


def test_a_missing_expert_tensor_fails_at_load_naming_it(int4_family, tmp_path) -> None:
    path, _ = int4_family
    name = next(n for n in load_file(path / "model.safetensors")
                if re.search(r"\.experts\.3\.(up_proj|w3)\.qzeros", n))
    bad = rewrite_checkpoint(path, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=rf"missing tensor\(s\) \['{re.escape(name)}'\]"):
        tiny_llm(bad)


def test_act_order_groups_are_refused_naming_the_tensor(dense_families, tmp_path) -> None:
    """A GPTQ checkpoint whose g_idx is not contiguous while its config says desc_act false, and one that
    says desc_act true: both refused at load."""
    src = dense_families["qwen3_moe"]
    path = tmp_path / "gptq"
    write_int4_moe_checkpoint(src, path, tmp_path / "deq", "gptq", GROUP)

    def shuffle(t: dict) -> dict:
        name = "model.layers.1.mlp.experts.2.down_proj.g_idx"
        return {**t, name: t[name].flip(0).contiguous()}

    bad = rewrite_checkpoint(path, tmp_path / "shuffled", shuffle)
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.g_idx: the groups are not contiguous"):
        _load(bad)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"routed experts model\.layers\.1\.mlp\.experts\.0\.gate_proj .*act-order"):
        _load(bad)


def test_groups_that_do_not_split_whole_over_the_ranks_are_refused(dense_families, tmp_path) -> None:
    """Groups of 128 and moe_intermediate_size 256 over 4 ranks leave 64 features each, half a group: the error
    names the first expert's down projection (no process started: building runs no collective); the dense
    linears, which would fail first for the same reason, are left out (``modules_to_not_convert``)."""
    path = tmp_path / "awq"
    write_int4_moe_checkpoint(dense_families["mixtral"], path, tmp_path / "deq", "awq", 128)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["self_attn"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.qweight: moe_intermediate_size 64 \(per rank 64 of 256"
                                         r".*\) is not a multiple of group_size=128"):
        _load(path, TPGroup(1, 4, torch.device("cpu")))


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False, "sym": True},
     "8-bit gptq experts are not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": True}, "act-order"),
])
def test_unsupported_gptq_experts_fail_at_load_naming_the_experts(dense_families, tmp_path, quant, match) -> None:
    path = rewrite_checkpoint(dense_families["qwen3_moe"], tmp_path / "q", lambda t: t)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ValueError, match=rf"routed experts model\.layers\.1\.mlp\.experts\.0\.gate_proj .*{match}"):
        _load(path)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_dummy_weights_in_the_int4_layout(dense_families, tmp_path, fmt) -> None:
    """``load_format="dummy"`` over an int4 config.json: random codes, zero point 8, scales that give
    dequantized experts of about N(0, 0.02); the engine generates."""
    path = tmp_path / fmt
    path.mkdir()
    for f in dense_families["glm4_moe"].iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": int4_moe_quant_config(fmt, GROUP)}))
    llm = tiny_llm(path, load_format="dummy")
    experts = _experts(llm.engine.runner.model)
    assert experts
    for e in experts:
        assert e.w13.dtype == torch.int32 and torch.equal(e.w13_zeros, torch.full_like(e.w13_zeros, 8))
        codes = torch.stack([unpack_int4_kernel(w) for w in e.w13])  # [E, H, 2I]
        w = (codes.float() - 8) * e.w13_scale.float().repeat_interleave(GROUP, 1)
        assert 0.015 < float(w.std()) < 0.025
    out = llm.generate([[5, 17, 33]], None, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["batched", "chunked"])
def test_cuda_triton_kernels_equal_transformers(int4_family, kw) -> None:
    """The int4 fused-MoE kernel, the int4 GEMM, attention, rotary and norm kernels on the GPU (fp32)."""
    check_cuda_triton_greedy(*int4_family, **kw)
