"""The paged-attention code-path variants ``bench kernels --variants`` times side by side.

Each ``Variant`` overrides fields of the launcher's ``AttentionConfig`` (paged_backend/kernels/paged_attention.py;
decode variants start from ``pick_config(..., baseline=True)``, prefill ones from the prefill
baseline) and optionally the context-split count; the sweep itself is ``attention_sweep.py``.
Pick winners from its tables and set them in ``pick_config`` / ``pick_num_splits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    """Overrides of the launcher's choice: AttentionConfig fields and a split rule."""

    name: str
    cfg: dict[str, Any] = field(default_factory=dict)
    splits: str = "auto"  # auto (the launcher's pick for this config), x2, /2, or a count ("32")
    kinds: tuple[str, ...] = ("bf16", "fp8")


_P4 = {"fp8_pairs": True, "offsets32": True, "maxnreg": 128, "programs_per_sm": 4}
DECODE_VARIANTS = [
    Variant("default"),
    Variant("pairs", {"fp8_pairs": True}, kinds=("fp8",)),
    Variant("pairs splits x2", {"fp8_pairs": True}, "x2", kinds=("fp8",)),
    Variant("pairs splits /2", {"fp8_pairs": True}, "/2", kinds=("fp8",)),
    Variant("pairs maxnreg128", {"fp8_pairs": True, "maxnreg": 128}, kinds=("fp8",)),
    Variant("pairs t64", {"fp8_pairs": True, "tile_n": 64}, kinds=("fp8",)),
    Variant("pairs t64 splits x2", {"fp8_pairs": True, "tile_n": 64}, "x2", kinds=("fp8",)),
    Variant("pairs stages4", {"fp8_pairs": True, "num_stages": 4}, kinds=("fp8",)),
    # 2026-11-30: context splits matched to the occupancy (programs_per_sm), fixed split counts
    Variant("o32", {"offsets32": True}, kinds=("bf16",)),
    Variant("o32 maxnreg168 sm3", {"offsets32": True, "maxnreg": 168, "programs_per_sm": 3}, kinds=("bf16",)),
    Variant("o32 n32", {"offsets32": True}, "32", kinds=("bf16",)),
    Variant("pairs sm3", {"fp8_pairs": True, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs o32 sm3", {"fp8_pairs": True, "offsets32": True, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs maxnreg128 sm4", {"fp8_pairs": True, "maxnreg": 128, "programs_per_sm": 4}, kinds=("fp8",)),
    Variant("pairs o32 maxnreg128 sm4", {"fp8_pairs": True, "offsets32": True, "maxnreg": 128,
                                         "programs_per_sm": 4}, kinds=("fp8",)),
    Variant("pairs stages4 sm3", {"fp8_pairs": True, "num_stages": 4, "programs_per_sm": 3}, kinds=("fp8",)),
    Variant("pairs t64 maxnreg128 sm4", {"fp8_pairs": True, "tile_n": 64, "maxnreg": 128, "programs_per_sm": 4},
            kinds=("fp8",)),
    Variant("pairs o32 n32", {"fp8_pairs": True, "offsets32": True}, "32", kinds=("fp8",)),
    Variant("pairs o32 n64", {"fp8_pairs": True, "offsets32": True}, "64", kinds=("fp8",)),
    Variant("pairs o32 maxnreg128 n64", {"fp8_pairs": True, "offsets32": True, "maxnreg": 128}, "64",
            kinds=("fp8",)),
    # 2026-11-30: split merge loading all splits at once (rb), launched programmatically dependent (pdl)
    # ("new": the decode defaults since 2026-11-30, timed against these as 'default')
    Variant("new sm3", {"offsets32": True, "reduce_block": 64, "pdl": True, "programs_per_sm": 3}, kinds=("bf16",)),
    Variant("new t64 stages4", {"offsets32": True, "reduce_block": 64, "pdl": True, "tile_n": 64, "num_stages": 4},
            kinds=("bf16",)),
    Variant("new fp8 t64 stages4", {**_P4, "reduce_block": 64, "pdl": True, "tile_n": 64, "num_stages": 4},
            kinds=("fp8",)),
    Variant("rb o32", {"offsets32": True, "reduce_block": 64}, kinds=("bf16",)),
    Variant("pdl o32", {"offsets32": True, "pdl": True}, kinds=("bf16",)),
    Variant("rb pdl o32", {"offsets32": True, "reduce_block": 64, "pdl": True}, kinds=("bf16",)),
    Variant("rb pdl o32 n64", {"offsets32": True, "reduce_block": 64, "pdl": True}, "64", kinds=("bf16",)),
    Variant("rb pdl o32 n8", {"offsets32": True, "reduce_block": 64, "pdl": True}, "8", kinds=("bf16",)),
    Variant("rb pairs o32 cap sm4", {**_P4, "reduce_block": 64}, kinds=("fp8",)),
    Variant("rb pdl pairs o32 cap sm4", {**_P4, "reduce_block": 64, "pdl": True}, kinds=("fp8",)),
    Variant("rb pdl pairs o32 sm3", {"fp8_pairs": True, "offsets32": True, "programs_per_sm": 3,
                                     "reduce_block": 64, "pdl": True}, kinds=("fp8",)),
    Variant("rb pdl pairs o32 cap n64", {**_P4, "reduce_block": 64, "pdl": True}, "64", kinds=("fp8",)),
    Variant("rb pdl pairs o32 cap n16", {**_P4, "reduce_block": 64, "pdl": True}, "16", kinds=("fp8",)),
]

_F2 = {"q_fold": 2, "offsets32": True}
PREFILL_VARIANTS = [
    Variant("default"),
    Variant("o32", {"offsets32": True}),
    Variant("fold2 o32", _F2),
    Variant("fold2 o32 stages5", {**_F2, "num_stages": 5}),
    Variant("fold2 o32 t64 stages5", {**_F2, "tile_n": 64, "num_stages": 5}),
    Variant("fold2 o32 t32 stages5 maxnreg128", {**_F2, "tile_n": 32, "num_stages": 5, "maxnreg": 128}),  # 2 CTAs/SM
    Variant("fold2 o32 m64 t64 w4 stages5", {**_F2, "block_m": 64, "tile_n": 64, "num_warps": 4, "num_stages": 5}),
    # 2026-11-30: 256-row q tiles (each K/V tile feeds twice the rows), one warpgroup per 128 rows
    Variant("m256 t64 stages3", {**_F2, "block_m": 256, "tile_n": 64, "num_stages": 3}),
    Variant("m256 t64 stages4", {**_F2, "block_m": 256, "tile_n": 64, "num_stages": 4}),
    Variant("m256 t64 stages5", {**_F2, "block_m": 256, "tile_n": 64, "num_stages": 5}),
    Variant("m256 t64 w16 stages4", {**_F2, "block_m": 256, "tile_n": 64, "num_warps": 16, "num_stages": 4}),
    Variant("m256 t128 w16 stages3", {**_F2, "block_m": 256, "tile_n": 128, "num_warps": 16, "num_stages": 3}),
    Variant("fold0 t32 stages5 maxnreg128", {"offsets32": True, "tile_n": 32, "num_stages": 5, "maxnreg": 128}),
    Variant("fold0 stages5", {"offsets32": True, "num_stages": 5}),
    Variant("fold0 m256 t64 stages3", {"offsets32": True, "block_m": 256, "tile_n": 64, "num_stages": 3}),
    Variant("fold0 m256 t64 stages4", {"offsets32": True, "block_m": 256, "tile_n": 64, "num_stages": 4}),
    Variant("m256 t32 stages4", {**_F2, "block_m": 256, "tile_n": 32, "num_stages": 4}),
    Variant("m256 t128 stages3", {**_F2, "block_m": 256, "tile_n": 128, "num_stages": 3}),
    Variant("m128 t64 w4 stages4", {**_F2, "tile_n": 64, "num_warps": 4, "num_stages": 4}),
    Variant("m128 t128 w4 stages4", {**_F2, "tile_n": 128, "num_warps": 4, "num_stages": 4}),
    Variant("m128 t64 stages5 maxnreg128", {**_F2, "tile_n": 64, "num_stages": 5, "maxnreg": 128}),
]


def parse_cells(spec: str) -> list[tuple[int, int]]:
    """'8x4096,1x32768' -> [(8, 4096), (1, 32768)]."""
    cells = []
    for item in spec.split(","):
        if item.strip():
            b, c = item.lower().split("x")
            cells.append((int(b), int(c)))
    return cells


def selected(variants: list[Variant], names: str | None) -> list[Variant]:
    """The variants named in ``names`` (comma-separated names or name prefixes), 'default' first;
    all of them when ``names`` is empty."""
    if not names:
        return list(variants)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    return [v for v in variants if v.name == "default" or any(v.name.startswith(w) for w in wanted)]
