"""The host tier as the prefix cache's second tier on the real SmolLM2 (fp32, CPU): a chat whose history
was evicted from a small device pool is served from the host tier on its next turn (counted host hits,
no device hits), its greedy tokens equal transformers', and an abort right after the step that copied
the history back leaves both pools whole; a prompt whose cached chain has a block on the host only between
blocks still on the device is served from both (in place on the device, copied in from the host) with
transformers' greedy tokens, and an abort right after that step leaves both pools whole."""

from __future__ import annotations

import pytest
import torch
from paged_backend.adapters.metrics import PrometheusMetrics
from smollm2 import LONG, MAX_NEW, assert_no_leak, hf_model, make_llm, prompt_ids

from paged_backend import SamplingParams
from paged_backend.core.block_hash import hash_block_tokens

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
FILLERS = [f"Note {i}. " + "The quick brown fox jumps over the lazy dog while the farmer watches. " * 8
           for i in range(2)]


def hf_greedy_ids(ids: list[int]) -> list[int]:
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = hf_model().generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_NEW, do_sample=False,
                                  pad_token_id=2)
    return out[0, len(ids):].tolist()


def metric(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def evict(llm) -> None:
    """Two unrelated prompts of 9 blocks each: every block of a 15-block device pool is taken since."""
    for text in FILLERS:
        llm.generate(text, GREEDY, use_tqdm=False)


def test_chat_history_evicted_from_the_device_comes_back_from_the_host_tier():
    # 15 usable device blocks of 16 tokens; ~70 host blocks
    llm = make_llm(num_gpu_blocks_override=16, swap_space=0.05)
    engine = llm.engine
    turn1 = prompt_ids(LONG + "In summary, the city was")
    reply = llm.generate([turn1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    history = turn1 + list(reply)
    full_blocks = (len(history) - 1) // 16  # the last token's K/V was never computed
    evict(llm)
    stats = engine.get_stats()
    assert engine.swap.num_written_back_blocks >= full_blocks
    turn2 = history + prompt_ids(" What happened to the markets later?")[1:]
    out = llm.generate([turn2], GREEDY, use_tqdm=False)[0]
    after = engine.get_stats()
    assert after["prefix_cache_hits"] == stats["prefix_cache_hits"]  # nothing left on the device...
    assert after["host_prefix_cache_hits"] - stats["host_prefix_cache_hits"] == full_blocks * 16  # ...all on the host
    assert list(out.outputs[0].token_ids) == hf_greedy_ids(turn2)
    assert_no_leak(engine)
    # Prometheus: the host tier's hits under vLLM's name for hits outside the GPU cache
    text = PrometheusMetrics("m", engine.get_stats).render()
    assert metric(text, "vllm:external_prefix_cache_hits_total") == after["host_prefix_cache_hits"] > 0
    assert metric(text, "vllm:external_prefix_cache_queries_total") == after["host_prefix_cache_queries"]
    assert metric(text, "vllm:prefix_cache_hits_total") == after["prefix_cache_hits"]

    # evicted again, then aborted right after the step that copied the history back in
    evict(llm)
    loaded = engine.swap.num_loaded_blocks
    engine.add_request("t2", turn2, GREEDY)
    engine.step()
    assert engine.swap.num_loaded_blocks - loaded == full_blocks
    engine.abort_request("t2")
    assert_no_leak(engine)
    assert all(b.ref_cnt == 0 for b in engine.swap.pool.blocks)


def chain_hashes(ids: list[int], n: int) -> list:
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, ids[i * 16:(i + 1) * 16])
        hashes.append(parent)
    return hashes


def make_gap(llm, ids: list[int], filler: str) -> list:
    """Leave the first 6 blocks of ``ids``' chain (at least 97 tokens) on the device but block 2, which is on
    the host only.

    On a pool whose 15 blocks are all free: y computes blocks 0-2; p, asking for prompt logprobs (no lookup),
    computes blocks 0-5 in 7 new blocks, of which 0-2 stay uncached (y's hold those hashes) and 3-5 are
    cached; y's blocks were freed first, so a 6-block filler takes the 4 other blocks, y's last block and its
    block 2 (written back to the host)."""
    engine = llm.engine
    llm.generate([ids[:49]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    llm.generate([ids[:97]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    llm.generate([prompt_ids(filler)[:81]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    hashes = chain_hashes(ids, 6)
    on_device = [engine.kv.block_pool.get_cached_block(h) is not None for h in hashes]
    on_host = [engine.swap.pool.get_cached_block(h) is not None for h in hashes]
    assert on_device == [True, True, False, True, True, True] and on_host[2]
    return hashes


def test_a_chain_served_part_from_the_device_and_part_from_the_host_keeps_greedy_tokens():
    llm = make_llm(num_gpu_blocks_override=16, swap_space=0.05)
    engine = llm.engine
    ids = prompt_ids(LONG)  # 109 tokens
    question = prompt_ids(" What happened to the markets later?")[1:]
    make_gap(llm, ids, FILLERS[0])
    stats, loaded = engine.get_stats(), engine.swap.num_loaded_blocks
    prompt = ids[:96] + question
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    after = engine.get_stats()
    # blocks 0-1 and 3-5 in place on the device, block 2 copied in from the host: 96 tokens not computed
    assert after["prefix_cache_hits"] - stats["prefix_cache_hits"] == 5 * 16
    assert after["host_prefix_cache_hits"] - stats["host_prefix_cache_hits"] == 16
    assert after["host_prefix_cache_queries"] - stats["host_prefix_cache_queries"] == len(prompt)
    assert engine.swap.num_loaded_blocks - loaded == 1 and out.usage.cached_tokens == 96
    assert list(out.outputs[0].token_ids) == hf_greedy_ids(prompt)
    assert_no_leak(engine)

    # another chain in the same state, aborted right after the step that loaded its block 2 (and computed
    # its prompt's remaining tokens beside the blocks shared in place)
    ids2 = prompt_ids("A second account. " + LONG)
    make_gap(llm, ids2, FILLERS[1])
    loaded = engine.swap.num_loaded_blocks
    engine.add_request("mixed", ids2[:96] + question, GREEDY)
    engine.step()
    assert engine.swap.num_loaded_blocks - loaded == 1
    engine.abort_request("mixed")
    assert_no_leak(engine)
    assert all(b.ref_cnt == 0 for b in engine.kv.block_pool.blocks + engine.swap.pool.blocks)
