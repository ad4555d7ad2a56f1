"""Model presets: the MoE layer shapes and routing of the models we serve (routed experts only)."""
from __future__ import annotations

import dataclasses

from .router import RoutingConfig, Scoring
from .grouped_gemm import Activation

__all__ = ["ModelPreset", "PRESETS", "get_preset", "custom_preset", "model_preset"]


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


def model_preset(model: str) -> ModelPreset:
    """A preset by name (any case), or 'custom:H,I,E,k[,ACTIVATION[,bias]]' (custom_preset; the prefix in any case):
    what the command lines' --model takes."""
    if not isinstance(model, str):
        raise TypeError(f"model: expected a preset name or 'custom:H,I,E,k[,...]', got {type(model).__name__}")
    if model[:len("custom:")].lower() == "custom:":
        return custom_preset(model[len("custom:"):])
    return get_preset(model)


def custom_preset(spec: str) -> ModelPreset:
    """'H,I,E,k' -> a softmax/renormalize SwiGLU preset named custom-H-I-E-k; 'H,I,E,k,ACTIVATION' picks the
    activation (an Activation value: swiglu, swiglu_oai, gelu_gated) and 'H,I,E,k,ACTIVATION,bias' adds w13 / w2
    biases (a gpt-oss-120b kind of layer: 'H,I,E,k,swiglu_oai,bias'). Spaces around a field are ignored; the
    integers are plain digits, the activation and `bias` in any case."""
    if not isinstance(spec, str):
        raise TypeError(f"custom: expected a string 'H,I,E,k[,ACTIVATION[,bias]]', got {type(spec).__name__}")
    fields = [field.strip() for field in spec.split(",")]
    if len(fields) < 4 or not all(field.isascii() and field.isdigit() for field in fields[:4]):
        raise ValueError(f"custom: expected 'H,I,E,k[,ACTIVATION[,bias]]' (four integers first), got {spec!r}")
    hidden, inter, experts, top_k = (int(x) for x in fields[:4])
    if min(hidden, inter, experts, top_k) < 1 or top_k > experts:
        raise ValueError(f"custom: expected positive H, I, E and 1 <= k <= E, got {spec!r}")
    if len(fields) > 6 or (len(fields) == 6 and fields[5].lower() != "bias"):
        raise ValueError(f"custom: expected 'H,I,E,k[,ACTIVATION[,bias]]', got {spec!r}")
    activation = Activation.SWIGLU
    if len(fields) >= 5:
        try:
            activation = Activation.parse(fields[4])
        except (TypeError, ValueError):
            names = ", ".join(a.value for a in Activation)
            raise ValueError(f"custom: activation {fields[4]!r} is none of {names} (in {spec!r})") from None
    has_bias = len(fields) == 6
    name = f"custom-{hidden}-{inter}-{experts}-{top_k}"
    if len(fields) >= 5:
        name += f"-{activation.value}" + ("-bias" if has_bias else "")
    return ModelPreset(name, hidden, inter, experts, RoutingConfig(top_k=top_k), activation, has_bias)
