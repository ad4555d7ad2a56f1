"""Model presets: the MoE layer shapes and routing of the models we serve (routed experts only)."""
from __future__ import annotations

import dataclasses

from .router import RoutingConfig, Scoring
from .grouped_gemm import Activation

__all__ = ["ModelPreset", "PRESETS", "get_preset", "custom_preset"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    hidden: int  # H
    intermediate: int  # I (per expert); w13 is [E, 2I, H], w2 is [E, H, I]
    num_experts: int  # E (routed)
    routing: RoutingConfig
    activation: Activation = Activation.SWIGLU
    has_bias: bool = False  # w13/w2 biases (gpt-oss)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def weight_bytes_per_expert(self, elem_bytes: int = 2) -> int:
        return 3 * self.hidden * self.intermediate * elem_bytes


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("mixtral-8x7b", 4096, 14336, 8, RoutingConfig(top_k=2, scoring=Scoring.SOFTMAX, renormalize=True)),
        ModelPreset("qwen3-30b-a3b", 2048, 768, 128, RoutingConfig(top_k=8, scoring=Scoring.SOFTMAX, renormalize=True)),
        ModelPreset("qwen3-235b-a22b", 4096, 1536, 128, RoutingConfig(top_k=8, scoring=Scoring.SOFTMAX, renormalize=True)),
        ModelPreset(
            "deepseek-v3",
            7168,
            2048,
            256,
            RoutingConfig(
                top_k=8,
                scoring=Scoring.SIGMOID_GROUPED,
                renormalize=True,
                num_expert_group=8,
                topk_group=4,
                routed_scaling_factor=2.5,
            ),
        ),
        ModelPreset(
            "gpt-oss-120b",
            2880,
            2880,
            128,
            RoutingConfig(top_k=4, scoring=Scoring.TOPK_SOFTMAX),
            activation=Activation.SWIGLU_OAI,
            has_bias=True,
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    key = name.lower()
    if key == "gpt-oss-120b-bf16":
        key = "gpt-oss-120b"
    if key not in PRESETS:
        raise ValueError(f"model: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[key]


def custom_preset(spec: str) -> ModelPreset:
    """'H,I,E,k' -> a softmax/renormalize SwiGLU preset named custom-H-I-E-k."""
    try:
        hidden, inter, experts, top_k = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"custom: expected 'H,I,E,k' (four integers), got {spec!r}") from None
    if min(hidden, inter, experts, top_k) < 1 or top_k > experts:
        raise ValueError(f"custom: expected positive H, I, E and 1 <= k <= E, got {spec!r}")
    return ModelPreset(f"custom-{hidden}-{inter}-{experts}-{top_k}", hidden, inter, experts, RoutingConfig(top_k=top_k))
