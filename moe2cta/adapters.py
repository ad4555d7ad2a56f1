"""Engine adapters: one MoE forward as a torch.library custom op, for callers that compile their model.

torch.compile, and the engines built on it (vLLM, SGLang), trace a model into graphs. A MoELayer call is Python host
logic around Triton and tvm-ffi launches, and tracing into it breaks the graph. These ops make one forward opaque to
the compiler: one node in the graph, traced through its fake implementation, run as the layer at execution.

    from moe2cta import adapters
    adapters.register_layer("model.layers.3.mlp.experts", layer)      # once, at weight load
    out = torch.ops.moe2cta.moe_forward(hidden, router_logits, "model.layers.3.mlp.experts")
    out = torch.ops.moe2cta.moe_forward_topk(hidden, topk_weights, topk_ids, "model.layers.3.mlp.experts")

A custom op's arguments are tensors and plain values, so the ops find their layer by name at call time (vLLM's own MoE
op does the same). The fake implementations check the shapes against the registered layer and return an empty
[T, H] tensor of hidden's dtype (T may be symbolic). At run time the op is the layer's own call, so it is exactly as
capturable in a CUDA graph as the layer. Inference only: the ops are not differentiable.

Importing this module registers the two ops (`import moe2cta` alone does not).
"""
from __future__ import annotations

import torch

from .api import MoELayer
from .config import IdCheck
from .validation import validate_moe

__all__ = ["register_layer", "unregister_layer", "registered_layer", "moe_forward", "moe_forward_topk"]

_LAYERS: dict[str, MoELayer] = {}


def register_layer(name: str, layer: MoELayer) -> str:
    """Make `layer` callable through the ops as `name`; returns name. Registering the same layer again is a no-op; a
    name that already holds another layer raises (unregister it first). The registry keeps the layer (and its
    weights) alive until unregister_layer(name)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    if not isinstance(layer, MoELayer):
        raise TypeError(f"layer: expected a moe2cta.MoELayer, got {type(layer).__name__}")
    held = _LAYERS.get(name)
    if held is not None and held is not layer:
        raise ValueError(f"name: {name!r} is already registered to another layer (unregister_layer({name!r}) first)")
    _LAYERS[name] = layer
    return name


def unregister_layer(name: str) -> None:
    """Forget the layer registered as `name` (the op then raises for it)."""
    if _LAYERS.pop(name, None) is None:
        raise ValueError(f"name: no layer is registered as {name!r}")


def registered_layer(name: str) -> MoELayer:
    """The layer registered as `name`."""
    layer = _LAYERS.get(name) if isinstance(name, str) else None
    if layer is None:
        raise ValueError(f"layer_name: no moe2cta layer is registered as {name!r} "
                         f"(moe2cta.adapters.register_layer; {len(_LAYERS)} registered)")
    return layer


def _unaliased(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """A custom op may not return its input or a view of it (an empty batch's output can be hidden itself)."""
    if out.numel() == 0:
        return torch.empty_like(out)
    if any(t.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs):
        return out.clone()
    return out


def _fake_output(layer: MoELayer, hidden: torch.Tensor, routing: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's input checks that read no values (shapes, dtypes, devices; not the range of topk_ids), as a
    tracer can afford them, then out [T, H] of hidden's dtype."""
    layer.check_hidden(hidden)
    validate_moe(
        hidden, layer.w13, layer.w2, routing=layer.config.routing, b13=layer.b13, b2=layer.b2,
        e_score_correction_bias=layer.e_score_correction_bias if "router_logits" in routing else None,
        expert_map=layer.expert_map, id_check=IdCheck.SKIP, router_logits=routing.get("router_logits"),
        topk_weights=routing.get("topk_weights"), topk_ids=routing.get("topk_ids"),
    )
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("moe2cta::moe_forward", mutates_args=())
def moe_forward(hidden: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    """hidden [T, H], router_logits [T, E_g] -> out [T, H]: the registered layer's forward with its own routing."""
    return _unaliased(registered_layer(layer_name)(hidden, router_logits), hidden, router_logits)


@moe_forward.register_fake
def _moe_forward_fake(hidden, router_logits, layer_name):
    return _fake_output(registered_layer(layer_name), hidden, {"router_logits": router_logits})


@torch.library.custom_op("moe2cta::moe_forward_topk", mutates_args=())
def moe_forward_topk(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     layer_name: str) -> torch.Tensor:
    """hidden [T, H], topk_weights [T, k], topk_ids [T, k] (routing done by the caller) -> out [T, H]."""
    out = registered_layer(layer_name)(hidden, topk_weights=topk_weights, topk_ids=topk_ids)
    return _unaliased(out, hidden, topk_weights)


@moe_forward_topk.register_fake
def _moe_forward_topk_fake(hidden, topk_weights, topk_ids, layer_name):
    return _fake_output(registered_layer(layer_name), hidden, {"topk_weights": topk_weights, "topk_ids": topk_ids})
