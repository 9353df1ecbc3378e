"""The rows of ``bench throughput``'s table (one per timed run, ours and transformers') and the table."""

from __future__ import annotations

from typing import Any


def result_row(label: str, device, dtype, kv_dtype, temperature: float, prompts: list[list[int]], n_gen: int,
               dt: float, peak_kv_usage: float | None = None, kv_waste: float | None = None) -> dict[str, Any]:
    """One row of the table: a timed run of ``prompts`` that generated ``n_gen`` tokens in ``dt`` s."""
    n_in = sum(len(p) for p in prompts)
    return dict(engine=label, device=str(device), dtype=str(dtype).replace("torch.", ""),
                kv=str(kv_dtype).replace("torch.", ""), temperature=temperature, prompts=len(prompts),
                input_tokens=n_in, output_tokens=n_gen, elapsed_s=round(dt, 3), req_s=round(len(prompts) / dt, 2),
                output_tok_s=round(n_gen / dt, 1), total_tok_s=round((n_gen + n_in) / dt, 1),
                peak_kv_usage=peak_kv_usage, kv_waste=kv_waste)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["engine", "device", "dtype", "kv", "temperature", "prompts", "input_tokens", "output_tokens", "elapsed_s", "req_s",
            "output_tok_s", "total_tok_s", "peak_kv_usage", "kv_waste", "preemptions"]
    widths = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c)).ljust(widths[c]) for c in cols))
