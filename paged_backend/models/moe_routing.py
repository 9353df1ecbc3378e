"""Mixture-of-experts routing: which experts each token goes to, and with what weight.

``RoutingConfig.from_hf_config(config_json_dict)`` reads every routing switch from the raw
config.json (also keys transformers does not type, e.g. ``scoring_func`` / ``topk_method`` of
DeepSeek checkpoints); a key that is absent (or null) takes the family's default as transformers
applies it:

    family        experts key        scoring   topk_method   norm_topk_prob   groups    scale
    qwen3_moe     num_experts        softmax   greedy        False            -         1.0
    mixtral       num_local_experts  softmax   greedy        always True      -         1.0
    glm4_moe      n_routed_experts   sigmoid   noaux_tc      True             1 / 1     1.0
    deepseek_v2   n_routed_experts   softmax   greedy        False            key / key 1.0
    deepseek_v3   n_routed_experts   sigmoid   noaux_tc      True             8 / 4     2.5

The three expert-count keys are aliases for every family (transformers 5 writes Qwen3-MoE's
count as ``num_local_experts``). ``select_experts(router_logits, cfg, bias)`` then runs in float32:

    scores   softmax(logits) | sigmoid(logits)
    choice   scores (+ e_score_correction_bias for noaux_tc)
    groups   n_group groups of E / n_group experts, each scored by its max choice
             (group_limited_greedy) or the sum of its two best choices (noaux_tc); experts
             outside the topk_group best groups are excluded
    ids      top-k of choice;  weights = scores at ids (the bias only selects)
    weights  / sum(weights) if norm_topk_prob;  then * routed_scaling_factor

The scaling factor is applied to the weights, as transformers does for GLM-4.5 and DeepSeek-V2/V3
(equal to scaling the routed output, shared experts excluded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# Per model_type: the defaults transformers applies when a key is absent.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
    "glm4_moe": {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "scoring_func": "sigmoid",
                 "topk_method": "noaux_tc"},
    "glm4_moe_lite": {"num_experts": 64, "num_experts_per_tok": 4, "norm_topk_prob": True, "scoring_func": "sigmoid",
                      "topk_method": "noaux_tc", "routed_scaling_factor": 1.8},
    "deepseek_v2": {"num_experts": 64},
    "deepseek_v3": {"num_experts": 256, "num_experts_per_tok": 8, "norm_topk_prob": True, "scoring_func": "sigmoid",
                    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
}
_GENERIC_DEFAULTS: dict[str, Any] = {"norm_topk_prob": False, "scoring_func": "softmax", "topk_method": "greedy",
                                     "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
# Switches a family's modeling code hard-codes whatever config.json says.
_FAMILY_FIXED: dict[str, dict[str, Any]] = {"mixtral": {"norm_topk_prob": True}}


@dataclass(frozen=True)
class RoutingConfig:
    """The routing switches of one MoE layer; field names are the config.json keys."""

    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        self._check_values()
        if self.grouped:
            self._check_groups()

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def grouped(self) -> bool:
        """Whether selection is limited to the best ``topk_group`` of ``n_group`` expert groups."""
        return self.topk_method in ("group_limited_greedy", "noaux_tc") and self.n_group > 1

    @property
    def uses_correction_bias(self) -> bool:
        """Whether ``e_score_correction_bias`` takes part in selection (noaux_tc)."""
        return self.topk_method == "noaux_tc"

    def _check_values(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported (use one of {SCORING_FUNCS})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported (use one of {TOPK_METHODS})")
        if self.num_experts < 1:
            raise ValueError(f"num_experts ({self.num_experts}) must be >= 1")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts = "
                             f"{self.num_experts}]")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(f"routed_scaling_factor ({self.routed_scaling_factor}) must be a positive number")
        if self.n_group < 1 or self.topk_group < 1:
            raise ValueError(f"n_group ({self.n_group}) and topk_group ({self.topk_group}) must be >= 1")

    def _check_groups(self) -> None:
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) does not divide num_experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        per_group = self.num_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(f"n_group ({self.n_group}) leaves {per_group} expert per group; noaux_tc scores a "
                             "group by its two best experts")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group "
                             f"({self.topk_group}) groups of {per_group}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> RoutingConfig:
        """The routing of a raw config.json dict (absent or null keys: the family's defaults)."""
        family = cfg.get("model_type")
        defaults = {**_GENERIC_DEFAULTS, **_FAMILY_DEFAULTS.get(family, {})}

        def read(key: str) -> Any:
            value = cfg.get(key)
            return defaults.get(key) if value is None else value

        values = {key: read(key) for key in ("num_experts_per_tok", "norm_topk_prob", "scoring_func", "topk_method",
                                             "n_group", "topk_group", "routed_scaling_factor")}
        values["num_experts"] = _expert_count(cfg, defaults.get("num_experts"))
        values.update(_FAMILY_FIXED.get(family, {}))
        if values["num_experts_per_tok"] is None:
            raise ValueError(f"config.json of model_type {family!r} must set num_experts_per_tok")
        return cls(
            num_experts=_as_int(values["num_experts"], "num_experts"),
            num_experts_per_tok=_as_int(values["num_experts_per_tok"], "num_experts_per_tok"),
            norm_topk_prob=_as_bool(values["norm_topk_prob"], "norm_topk_prob"),
            scoring_func=str(values["scoring_func"]),
            topk_method=str(values["topk_method"]),
            n_group=_as_int(values["n_group"], "n_group"),
            topk_group=_as_int(values["topk_group"], "topk_group"),
            routed_scaling_factor=_as_float(values["routed_scaling_factor"], "routed_scaling_factor"),
        )


def _expert_count(cfg: dict[str, Any], default: int | None) -> int:
    """The routed expert count from whichever alias key is set (they must agree)."""
    found = {key: cfg[key] for key in EXPERT_COUNT_KEYS if cfg.get(key) is not None}
    if len(set(found.values())) > 1:
        raise ValueError(f"config.json sets different expert counts: {found}")
    if found:
        return next(iter(found.values()))
    if default is None:
        raise ValueError(f"config.json must set the number of routed experts (one of {EXPERT_COUNT_KEYS})")
    return default


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _as_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


# -- selection ----------------------------------------------------------------------------------


def _group_mask(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """bool [M, E]: experts inside each row's ``topk_group`` best groups."""
    m = choice.shape[0]
    per_group = cfg.num_experts // cfg.n_group
    grouped = choice.view(m, cfg.n_group, per_group)
    if cfg.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = group_scores.topk(cfg.topk_group, dim=-1).indices
    keep = torch.zeros(m, cfg.n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return keep.repeat_interleave(per_group, dim=1)


def select_experts(
    router_logits: torch.Tensor,
    cfg: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, K], topk_ids int64 [M, K]) of ``router_logits`` [M, E].

    ``e_score_correction_bias`` [E] takes part only for noaux_tc (None: no correction).
    Rows are ordered by descending selection score.
    """
    if router_logits.dim() != 2 or router_logits.shape[1] != cfg.num_experts:
        raise ValueError(f"router_logits must be [M, {cfg.num_experts}], got {tuple(router_logits.shape)}")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores
    if cfg.uses_correction_bias and e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()
    if cfg.grouped:
        choice = choice.masked_fill(~_group_mask(choice, cfg), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids
