"""Regenerates the small quantized checkpoints under tests/quant_checkpoints/ with the reference tools.

Run through ``make_checkpoints.sh`` (it builds the separate venvs with the tools; the test venv
never needs them). Steps, each writing ``<name>/`` (model + tokenizer) and
``<name>/reference.pt`` (prompts, the tool's own logits, its greedy continuation):

    base      seeded tiny Llama (vocab 512, hidden 256, 2 layers) + a tiny BPE tokenizer, fp16
    gptq*     GPTQModel 7.6.0 (desc_act off / on), logits from GPTQModel's own CPU kernel
    awq       AutoAWQ 0.2.9 GEMM, logits from AutoAWQ's own WQLinear_GEMM (torch dequant on CPU)
    ct-*      llm-compressor: W4A16 pack-quantized and FP8 (compressed-tensors), logits from
              transformers loading the checkpoint (compressed-tensors decompression)

    python make_checkpoints.py base|gptq|awq|ct  [--out DIR]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SEED = 1234
PROMPTS = [  # fixed prompts, tokenized by the tiny tokenizer
    "def quantize(weight, scale):\n    return",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\n\nclass Config:",
]
NEW_TOKENS = 8
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def corpus() -> list[str]:
    """Deterministic text (stdlib sources) for the tokenizer and the calibration set."""
    import argparse as a
    import json as j
    import textwrap as t

    text = "\n".join(inspect.getsource(m) for m in (a, j, t))
    return [text[i : i + 1200] for i in range(0, len(text), 1200)]


def make_base(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    torch.manual_seed(SEED)
    config = LlamaConfig(**TINY)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # larger-than-default weights so the logits have clear winners
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.06 * noise)
    model = model.half()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)


def calibration(tokenizer, n: int = 32, seq: int = 128) -> list[list[int]]:
    ids = tokenizer("\n".join(corpus()))["input_ids"]
    return [ids[i * seq : (i + 1) * seq] for i in range(n)]


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@torch.no_grad()
def save_reference(model, tokenizer, out: Path, tool: str) -> None:
    """Per prompt: full-prompt logits (float32) and the greedy continuation, by ``model`` itself."""
    refs = []
    for ids in prompt_ids(tokenizer):
        seq = list(ids)
        logits = None
        for _ in range(NEW_TOKENS):
            step = model(torch.tensor([seq])).logits[0].float()
            if logits is None:
                logits = step
            seq.append(int(step[-1].argmax()))
        refs.append({"prompt_ids": ids, "logits": logits, "greedy": seq[len(ids):]})
    torch.save({"tool": tool, "refs": refs}, out / "reference.pt")


def make_gptq(base: Path, out: Path, desc_act: bool, group_size: int) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    qc = QuantizeConfig(bits=4, group_size=group_size, desc_act=desc_act, sym=True)
    model = GPTQModel.load(str(base), qc, device="cpu")
    calib = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration(tokenizer)]
    model.quantize(calib, batch_size=4)
    model.save(str(out))
    del model
    write_gptq_reference(out)


def write_gptq_reference(out: Path) -> None:
    """GPTQModel's own torch kernel (TorchLinear: dequantize + matmul), run in float32."""
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoTokenizer

    qmodel = GPTQModel.load(str(out), device="cpu", dtype=torch.float16, backend=BACKEND.TORCH)
    qmodel.model.float()  # TorchLinear only loads as fp16/bf16; cast so its dequant + matmul run in fp32
    save_reference(qmodel.model, AutoTokenizer.from_pretrained(out), out, f"gptqmodel {_version('gptqmodel')} TorchLinear fp32")


def make_awq(base: Path, out: Path, group_size: int) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoAWQForCausalLM.from_pretrained(str(base), device_map="cpu")
    qc = {"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": "GEMM"}
    texts = [tokenizer.decode(ids) for ids in calibration(tokenizer)]
    model.quantize(tokenizer, quant_config=qc, calib_data=texts, max_calib_seq_len=128, n_parallel_calib_samples=8)
    model.save_quantized(str(out))
    tokenizer.save_pretrained(out)
    del model
    write_awq_reference(out)


def write_awq_reference(out: Path) -> None:
    """AutoAWQ's own dequantization (``dequantize_gemm`` of each loaded WQLinear_GEMM) in a float32 model.

    WQLinear_GEMM's CPU forward casts activations to fp16, too coarse a reference for a float32
    engine, so each layer is replaced by a dense float32 Linear holding AutoAWQ's own
    dequantized weight. from_quantized insists on intel_extension_for_pytorch on a CPU unless
    the device probe says otherwise, so the probe is overridden (the modules are the same).
    """
    import awq.models.base as awq_base
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm
    from transformers import AutoTokenizer

    awq_base.get_best_device = lambda: "cpu-torch-path"
    qmodel = AutoAWQForCausalLM.from_quantized(str(out), device_map={"": "cpu"}, fuse_layers=False)
    model = qmodel.model
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "WQLinear_GEMM":
            continue
        w = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.w_bit, module.group_size)
        dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        dense.weight.data = w.t().contiguous().float()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, dense)
        replaced += 1
    assert replaced == 2 * 7, replaced
    model.float()
    save_reference(model, AutoTokenizer.from_pretrained(out), out,
                   f"autoawq {_version('autoawq')} dequantize_gemm -> transformers fp32")


def make_ct(base: Path, out: Path, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float16)
    if scheme == "W4A16":
        from datasets import Dataset

        calib = Dataset.from_list([{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration(tokenizer)])
        recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
        oneshot(model=model, dataset=calib, recipe=recipe, max_seq_length=128, num_calibration_samples=32)
    else:  # FP8_DYNAMIC: per-channel fp8 weights, dynamic per-token fp8 activations (no calibration)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    del model
    write_ct_reference(out)


def write_ct_reference(out: Path) -> None:
    """transformers loading the compressed-tensors checkpoint (its decompression), run in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    qmodel = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    print(out.name, type(qmodel.model.layers[0].self_attn.q_proj), getattr(qmodel.model.layers[0].self_attn.q_proj, "quantization_scheme", None))
    save_reference(qmodel, AutoTokenizer.from_pretrained(out), out,
                   f"llmcompressor {_version('llmcompressor')} + transformers {_version('transformers')} fp32")


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["base", "gptq", "gptq-ref", "awq", "awq-ref", "ct", "ct-ref"])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    base = args.out / "base"
    torch.manual_seed(SEED)
    if args.step == "base":
        make_base(_fresh(base))
    elif args.step == "gptq":
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
        make_gptq(base, _fresh(args.out / "gptq-g32"), desc_act=False, group_size=32)
        make_gptq(base, _fresh(args.out / "gptq-g64-act-order"), desc_act=True, group_size=64)
    elif args.step == "gptq-ref":  # references only, for existing checkpoints
        for name in ("gptq-g32", "gptq-g64-act-order"):
            write_gptq_reference(args.out / name)
    elif args.step == "awq-ref":
        write_awq_reference(args.out / "awq-g64")
    elif args.step == "ct-ref":
        for name in ("ct-w4a16-g128", "ct-fp8-dynamic"):
            write_ct_reference(args.out / name)
    elif args.step == "awq":
        make_awq(base, _fresh(args.out / "awq-g64"), group_size=64)
    else:
        make_ct(base, _fresh(args.out / "ct-w4a16-g128"), "W4A16")
        make_ct(base, _fresh(args.out / "ct-fp8-dynamic"), "FP8_DYNAMIC")
    print(json.dumps({"done": args.step, "out": str(args.out)}))


if __name__ == "__main__":
    main()
