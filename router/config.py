"""Routing configuration: how router logits become (topk_weights, topk_ids)."""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import os
import sys

__all__ = ["Scoring", "RoutingConfig"]


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter now: triton.knobs once Triton is imported, else
    TRITON_INTERPRET parsed as Triton parses it ("1", "true", "yes", "on", "y"). Read at call time."""
    knobs = getattr(sys.modules.get("triton"), "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1). Plain int arithmetic: Triton's next_power_of_2 is a constexpr
    function whose host call costs ~8 us on Triton 3.9."""
    return 1 << max(0, int(n) - 1).bit_length()


def parse_enum(enum_cls, value, argument: str):
    """`value` as a member of enum_cls: a member, or a string matching a member's value or name
    (case-insensitive); else ValueError naming `argument` and the accepted values."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        for member in enum_cls:
            if value.lower() in (str(member.value).lower(), member.name.lower()):
                return member
    raise ValueError(f"{argument}: expected one of {[m.value for m in enum_cls]}, got {value!r}")


class Scoring(enum.Enum):
    """How router logits are scored and selected. Ties go to the lower expert index."""

    SOFTMAX = "softmax"  # softmax over all E, then top-k of the probabilities (Mixtral, Qwen3, gpt-oss)
    TOPK_SOFTMAX = "topk_softmax"  # top-k of the logits, then softmax over the k selected
    SIGMOID_GROUPED = "sigmoid_grouped"  # DeepSeek-V3: sigmoid; biased, group-limited selection
    SIGMOID_TOP1 = "sigmoid_top1"  # Llama4: top-k of the logits, weight = sigmoid(logit)

    @classmethod
    def parse(cls, value: "Scoring | str") -> "Scoring":
        return parse_enum(cls, value, "scoring")


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """Static routing facts of a model.

    scoring: see Scoring. top_k: experts per token. renormalize: divide the k weights by their sum
    (SOFTMAX, SIGMOID_GROUPED and SIGMOID_TOP1 with k > 1; TOPK_SOFTMAX is normalized by construction). num_expert_group /
    topk_group: group-limited selection (SIGMOID_GROUPED only; None = no groups): experts are split into
    num_expert_group equal groups, each group scored by the sum of its two best biased scores, the best
    topk_group groups kept, then top-k among their experts. routed_scaling_factor multiplies the final
    weights. The correction bias is a tensor argument of route(), not config.
    """

    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "scoring", Scoring.parse(self.scoring))
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise ValueError(f"top_k: expected an int >= 1, got {self.top_k!r}")
        if not isinstance(self.renormalize, bool):
            raise TypeError(f"renormalize: expected a bool, got {self.renormalize!r}")
        for name in ("num_expert_group", "topk_group"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"{name}: expected an int or None, got {value!r}")
        factor = self.routed_scaling_factor
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool):
            raise TypeError(f"routed_scaling_factor: expected a real number, got {factor!r}")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"routed_scaling_factor: expected a finite number > 0, got {factor!r}")
        object.__setattr__(self, "routed_scaling_factor", float(factor))
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError(
                "num_expert_group, topk_group: expected both or neither, got "
                f"{self.num_expert_group!r}, {self.topk_group!r}"
            )
        if self.num_expert_group is not None:
            if self.scoring is not Scoring.SIGMOID_GROUPED:
                raise ValueError(
                    f"num_expert_group: group-limited top-k needs scoring=SIGMOID_GROUPED, got {self.scoring}"
                )
            if self.num_expert_group < 1:
                raise ValueError(f"num_expert_group: expected >= 1, got {self.num_expert_group}")
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(
                    f"topk_group: expected 1..num_expert_group ({self.num_expert_group}), got {self.topk_group}"
                )

    def check_num_experts(self, num_experts: int) -> None:
        """Raise ValueError if this config cannot route over num_experts experts."""
        if self.top_k > num_experts:
            raise ValueError(f"top_k: expected <= num_experts ({num_experts}), got {self.top_k}")
        if self.num_expert_group is not None:
            if num_experts % self.num_expert_group:
                raise ValueError(
                    f"num_expert_group: expected a divisor of num_experts ({num_experts}), got {self.num_expert_group}"
                )
            per_group = num_experts // self.num_expert_group
            if self.topk_group * per_group < self.top_k:
                raise ValueError(
                    f"topk_group: {self.topk_group} groups of {per_group} experts hold fewer than top_k={self.top_k}"
                )
        if self.scoring is Scoring.SIGMOID_GROUPED and self.num_expert_group is not None:
            if num_experts // self.num_expert_group < 2:
                raise ValueError("num_expert_group: group scoring sums the 2 best experts; groups need >= 2 experts")
