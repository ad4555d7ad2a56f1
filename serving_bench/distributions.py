"""Routing distributions: how the benchmark makes router logits, and what the routing did with them.

UNIFORM gives i.i.d. N(0, 1) logits and lets the model's real router decide (for DeepSeek-V3 that is the
sigmoid, bias-corrected, group-limited selection with a random e_score_correction_bias). The other kinds
choose each token's k experts first and then write logits that make exactly those experts win under every
scoring of moe2cta.router.Scoring: chosen experts get logits near +4, the others near -4, so softmax,
top-k-softmax and sigmoid scores (with a correction bias of |b| <= 0.05) all select the chosen set. For
group-limited routing the choice respects the groups (at most topk_group groups per token).

- BALANCED: slot t*k + j goes to expert (t*k + j + offset) % E: every expert gets T*k/E slots (+-1).
- ZIPF (param s, default 1.2): expert popularity ~ 1 / rank^s over a random ranking of the experts.
- DIRICHLET (param alpha, default 0.3): popularity ~ Dirichlet(alpha, ..., alpha); small alpha = skewed.
- HOT: one expert (random) is in every token's top-k; the other k-1 are uniform over the rest.

BenchRouter says which router turns the logits into top-k: MODEL, each preset's own (the default); PEER, softmax ->
top-k -> renormalize for every preset, as the peer figures of shared/bench/peers-h200-2026-11-29.md were measured.
The two select the same experts for every preset but DeepSeek-V3. Its MODEL router on i.i.d. logits lets the random
correction bias skew the loads (about 2.1x the mean on the busiest expert at T >= 2048, against 1.04-1.36x for the
others): a trained model's bias is learned to balance its loads, and i.i.d. logits have nothing to balance.
"""
from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch

from moe2cta.presets import ModelPreset
from moe2cta.router import RoutingConfig, Scoring

__all__ = [
    "BenchRouter",
    "DistributionKind",
    "RoutingDistribution",
    "make_router_logits",
    "make_correction_bias",
    "LoadSummary",
    "summarize_load",
]

CHOSEN_LOGIT = 4.0
OTHER_LOGIT = -4.0
LOGIT_NOISE = 0.5
CORRECTION_BIAS_RANGE = 0.05


class BenchRouter(enum.Enum):
    """Which router the benchmark runs on the logits (module docstring)."""

    MODEL = "model"  # each preset's own RoutingConfig
    PEER = "peer"  # softmax -> top-k -> renormalize, no correction bias, no scaling factor

    def describe(self) -> str:
        if self is BenchRouter.PEER:
            return "softmax -> top-k -> renormalize for every model (the peer figures' routing)"
        return "each model's own router"

    def apply(self, preset: ModelPreset) -> ModelPreset:
        """`preset` with this router's RoutingConfig (MODEL: unchanged)."""
        if not isinstance(preset, ModelPreset):
            raise TypeError(f"preset: expected a ModelPreset, got {type(preset).__name__}")
        if self is BenchRouter.MODEL:
            return preset
        return dataclasses.replace(preset, routing=RoutingConfig(top_k=preset.top_k, scoring=Scoring.SOFTMAX,
                                                                 renormalize=True))


class DistributionKind(enum.Enum):
    UNIFORM = "uniform"
    BALANCED = "balanced"
    ZIPF = "zipf"
    DIRICHLET = "dirichlet"
    HOT = "hot"


_DEFAULT_PARAM = {DistributionKind.ZIPF: 1.2, DistributionKind.DIRICHLET: 0.3}


@dataclasses.dataclass(frozen=True)
class RoutingDistribution:
    """A routing distribution kind and its parameter (ZIPF: exponent s; DIRICHLET: alpha; else None)."""

    kind: DistributionKind
    param: float | None = None

    def __post_init__(self):
        if not isinstance(self.kind, DistributionKind):
            raise TypeError(f"kind: expected a DistributionKind, got {self.kind!r}")
        if self.kind in _DEFAULT_PARAM:
            if self.param is None:
                object.__setattr__(self, "param", _DEFAULT_PARAM[self.kind])
            if not float(self.param) > 0:
                raise ValueError(f"param: {self.kind.value} needs a parameter > 0, got {self.param!r}")
            object.__setattr__(self, "param", float(self.param))
        elif self.param is not None:
            raise ValueError(f"param: {self.kind.value} takes no parameter, got {self.param!r}")

    @classmethod
    def parse(cls, text: "str | RoutingDistribution") -> "RoutingDistribution":
        """'uniform', 'balanced', 'hot', 'zipf', 'zipf:1.5', 'dirichlet:0.1'."""
        if isinstance(text, cls):
            return text
        name, _, param = str(text).strip().lower().partition(":")
        for kind in DistributionKind:
            if kind.value == name:
                if not param:
                    return cls(kind)
                try:
                    value = float(param)
                except ValueError:
                    raise ValueError(f"routing: parameter of {name!r} must be a number, got {param!r}") from None
                return cls(kind, value)
        raise ValueError(
            f"routing: expected one of {[k.value for k in DistributionKind]} (zipf:S, dirichlet:ALPHA), got {text!r}"
        )

    @property
    def label(self) -> str:
        if self.kind is DistributionKind.ZIPF:
            return f"zipf(s={self.param:g})"
        if self.kind is DistributionKind.DIRICHLET:
            return f"dirichlet(alpha={self.param:g})"
        return self.kind.value

    def describe(self) -> str:
        if self.kind is DistributionKind.ZIPF:
            return f"skewed: expert popularity ~ 1/rank^{self.param:g}"
        if self.kind is DistributionKind.DIRICHLET:
            return f"skewed: expert popularity ~ Dirichlet(alpha={self.param:g})"
        return {
            DistributionKind.UNIFORM: "i.i.d. N(0,1) router logits, routed by the run's router",
            DistributionKind.BALANCED: "perfectly balanced: every expert gets T*k/E slots (+-1)",
            DistributionKind.HOT: "one hot expert in every token's top-k, the rest uniform",
        }[self.kind]


def make_correction_bias(num_experts: int, *, seed: int, device) -> torch.Tensor:
    """A random DeepSeek-V3 style e_score_correction_bias, uniform in [-0.05, 0.05], fp32 [E]."""
    rng = np.random.default_rng(seed)
    values = rng.uniform(-CORRECTION_BIAS_RANGE, CORRECTION_BIAS_RANGE, size=num_experts)
    return torch.tensor(values, dtype=torch.float32, device=device)


def make_router_logits(
    distribution: RoutingDistribution,
    num_tokens: int,
    num_experts: int,
    routing: RoutingConfig,
    *,
    seed: int,
    device,
) -> torch.Tensor:
    """Router logits fp32 [num_tokens, num_experts] drawn from `distribution` (deterministic in seed)."""
    if not isinstance(distribution, RoutingDistribution):
        raise TypeError(f"distribution: expected a RoutingDistribution, got {type(distribution).__name__}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected >= 1, got {num_tokens}")
    routing.check_num_experts(num_experts)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if distribution.kind is DistributionKind.UNIFORM:
        return torch.randn(num_tokens, num_experts, generator=gen).to(device)
    rng = np.random.default_rng(seed)
    choices = _choose_experts(distribution, num_tokens, num_experts, routing, gen, rng)
    logits = OTHER_LOGIT + LOGIT_NOISE * torch.randn(num_tokens, num_experts, generator=gen)
    chosen = CHOSEN_LOGIT + LOGIT_NOISE * torch.randn(num_tokens, routing.top_k, generator=gen)
    logits.scatter_(1, choices, chosen)
    return logits.to(device)


def _groups(routing: RoutingConfig) -> tuple[int, int] | None:
    if routing.num_expert_group is None:
        return None
    return routing.num_expert_group, routing.topk_group


def _choose_experts(dist, num_tokens, num_experts, routing, gen, rng) -> torch.Tensor:
    """int64 [T, k]: the k distinct experts each token should be routed to."""
    k = routing.top_k
    if dist.kind is DistributionKind.BALANCED:
        offset = int(rng.integers(num_experts))
        slots = torch.arange(num_tokens * k, dtype=torch.int64).view(num_tokens, k)
        choices = (slots + offset) % num_experts
        groups = _groups(routing)
        if groups is not None:
            per_group = num_experts // groups[0]
            spanned = (choices // per_group).sort(dim=1).values
            n_groups = 1 + (spanned[:, 1:] != spanned[:, :-1]).sum(dim=1)
            if int(n_groups.max()) > groups[1]:
                raise ValueError(
                    f"routing: balanced distribution needs k={k} consecutive experts to span <= topk_group="
                    f"{groups[1]} groups of {per_group}"
                )
        return choices
    hot = None
    if dist.kind is DistributionKind.ZIPF:
        ranks = rng.permutation(num_experts)
        popularity = 1.0 / np.power(ranks + 1.0, dist.param)
    elif dist.kind is DistributionKind.DIRICHLET:
        popularity = rng.dirichlet(np.full(num_experts, dist.param))
    elif dist.kind is DistributionKind.HOT:
        hot = int(rng.integers(num_experts))
        popularity = np.ones(num_experts)
    else:
        raise ValueError(f"distribution: unknown kind {dist.kind!r}")
    popularity = torch.tensor(popularity, dtype=torch.float64) + 1e-12
    popularity = popularity / popularity.sum()
    return _sample_without_replacement(popularity, num_tokens, k, _groups(routing), hot, gen)


def _sample_without_replacement(popularity, num_tokens, k, groups, hot, gen) -> torch.Tensor:
    num_experts = popularity.numel()
    weights = popularity.expand(num_tokens, num_experts).clone()
    if groups is not None:
        num_groups, keep_groups = groups
        per_group = num_experts // num_groups
        group_weights = weights.view(num_tokens, num_groups, per_group).sum(dim=2)
        if hot is not None:
            hot_group = hot // per_group
            group_weights[:, hot_group] = 0.0
            picked = [torch.full((num_tokens, 1), hot_group, dtype=torch.int64)]
            if keep_groups > 1:
                picked.append(torch.multinomial(group_weights, keep_groups - 1, generator=gen))
            picked = torch.cat(picked, dim=1)
        else:
            picked = torch.multinomial(group_weights, keep_groups, generator=gen)
        allowed = torch.zeros(num_tokens, num_groups, dtype=torch.bool)
        allowed.scatter_(1, picked, True)
        weights = weights * allowed.repeat_interleave(per_group, dim=1)
    if hot is None:
        return torch.multinomial(weights, k, generator=gen)
    weights[:, hot] = 0.0
    hot_column = torch.full((num_tokens, 1), hot, dtype=torch.int64)
    if k == 1:
        return hot_column
    return torch.cat([hot_column, torch.multinomial(weights, k - 1, generator=gen)], dim=1)


@dataclasses.dataclass(frozen=True)
class LoadSummary:
    """How the routed slots of one batch spread over the experts."""

    experts_hit: int
    num_experts: int
    max_load: int  # slots on the busiest expert
    mean_load: float  # slots per hit expert

    @property
    def imbalance(self) -> float:
        """busiest expert / mean over hit experts (1.0 = balanced)."""
        return self.max_load / self.mean_load if self.mean_load else 0.0

    def describe(self) -> str:
        return f"{self.experts_hit}/{self.num_experts} experts hit, busiest {self.max_load} slots ({self.imbalance:.2f}x mean)"


def summarize_load(topk_ids: torch.Tensor, num_experts: int) -> LoadSummary:
    counts = torch.bincount(topk_ids.reshape(-1).long().cpu(), minlength=num_experts)
    hit = int((counts > 0).sum())
    return LoadSummary(hit, num_experts, int(counts.max()), float(counts.sum()) / max(hit, 1))
