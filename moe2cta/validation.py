"""Input checks of the public API: every bad input becomes a ValueError or TypeError naming the argument.

The checks read shapes, dtypes and devices only, so they cost no device sync and run before any kernel.
The one exception is the range of topk_ids / expert_map values: checking them needs the values on the host,
so it runs only when asked (IdCheck.CHECK; IdCheck.AUTO resolves to CHECK on the TORCH backend and for
CPU tensors and to SKIP on the CUDA hot path, see moe2cta.config.IdCheck).

Accepted inputs (T tokens, H hidden, I intermediate, E local experts, E_g global experts, k = top_k):
- hidden [T, H] bf16 / fp16 / fp32; T may be 0.
- w13 [E, 2I, H] and w2 [E, H, I] in hidden's dtype; b13 [E, 2I], b2 [E, H] in hidden's dtype or fp32.
- either router_logits [T, E_g] (any of the three float dtypes) with a RoutingConfig, or precomputed
  topk_weights [T, k] (any float dtype; used as fp32) with topk_ids [T, k] (int32 / int64).
- e_score_correction_bias [E_g] float, only with Scoring.SIGMOID_GROUPED.
- expert_map [E_g] int32 / int64: global id -> local id in [0, E) or -1 (not on this rank); without it
  E_g = E. topk_ids values lie in [0, E_g), or are -1 (slot unused) when expert_map is given.
- every tensor on hidden's device.
NaN / inf are not scanned for (that would need a sync): see moe2cta.api for what they do.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

import torch

from .config import IdCheck
from .router import RoutingConfig, Scoring

__all__ = [
    "FLOAT_DTYPES",
    "MoEProblem",
    "require_tensor",
    "check_weights",
    "check_logits",
    "check_topk",
    "check_id_values",
    "check_expert_map_values",
    "validate_moe",
    "output_dir",
    "output_file",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    """Shapes and placement of one call, as read from the tensors (no values)."""

    num_tokens: int  # T
    hidden: int  # H
    intermediate: int  # I
    num_experts: int  # E, local experts (w13.shape[0])
    num_global_experts: int  # E_g: router width (expert_map length, else E)
    top_k: int  # k
    dtype: torch.dtype
    device: torch.device
    has_bias: bool


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def require_tensor(name: str, value, *, ndim: int | None = None, dtypes=None) -> torch.Tensor:
    """TypeError unless value is a tensor (of one of `dtypes`); ValueError unless it has `ndim` dims."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[_dtype_name(d) for d in dtypes]}, got {_dtype_name(value.dtype)}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(value.shape)}")
    return value


def _require_shape(name: str, tensor: torch.Tensor, expected: tuple, meaning: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({meaning}), got {tuple(tensor.shape)}")


def _require_device(name: str, tensor: torch.Tensor | None, device: torch.device) -> None:
    if tensor is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the other inputs), got {tensor.device}")


def check_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    names: tuple[str, str, str, str] = ("w13", "w2", "b13", "b2"),
) -> tuple[int, int, int, int]:
    """Shapes, dtypes and devices of the expert weights -> (E local, I, H, E global). `names`: what the errors call
    w13, w2, b13 and b2 (the caller's argument names)."""
    n13, n2, nb13, nb2 = names
    require_tensor(n13, w13, dtypes=FLOAT_DTYPES)
    if w13.dim() != 3:
        raise ValueError(f"{n13}: expected a 3-D tensor [E, 2I, H], got shape {tuple(w13.shape)}")
    num_experts, two_i, hidden = w13.shape
    if num_experts < 1 or hidden < 1 or two_i < 2 or two_i % 2:
        raise ValueError(f"{n13}: expected shape [E, 2I, H] with E >= 1, I >= 1, H >= 1, got {tuple(w13.shape)}")
    intermediate = two_i // 2
    require_tensor(n2, w2, dtypes=FLOAT_DTYPES)
    if w2.dim() != 3:
        raise ValueError(f"{n2}: expected a 3-D tensor [E, H, I], got shape {tuple(w2.shape)}")
    _require_shape(n2, w2, (num_experts, hidden, intermediate), f"[E, H, I] with E, H, I from {n13} [E, 2I, H]")
    if w2.dtype != w13.dtype:
        raise TypeError(f"{n2}: expected dtype {_dtype_name(w13.dtype)} (the dtype of {n13}), got {_dtype_name(w2.dtype)}")
    device = w13.device
    _require_device(n2, w2, device)
    for name, bias, shape in ((nb13, b13, (num_experts, two_i)), (nb2, b2, (num_experts, hidden))):
        if bias is None:
            continue
        require_tensor(name, bias)
        if bias.dtype not in (w13.dtype, torch.float32):
            allowed = _dtype_name(w13.dtype) + (" (the weights' dtype) or float32" if w13.dtype != torch.float32 else "")
            raise TypeError(f"{name}: expected dtype {allowed}, got {_dtype_name(bias.dtype)}")
        _require_shape(name, bias, shape, "[E, 2I]" if name == nb13 else "[E, H]")
        _require_device(name, bias, device)
    num_global = num_experts
    if expert_map is not None:
        require_tensor("expert_map", expert_map, ndim=1, dtypes=INT_DTYPES)
        if expert_map.shape[0] < num_experts:
            raise ValueError(
                f"expert_map: expected one entry per global expert, at least E={num_experts} (the local expert "
                f"count of {n13}), got {expert_map.shape[0]}"
            )
        _require_device("expert_map", expert_map, device)
        num_global = expert_map.shape[0]
    return num_experts, intermediate, hidden, num_global


def check_logits(
    logits: torch.Tensor,
    routing: RoutingConfig,
    num_global_experts: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    name: str = "router_logits",
) -> None:
    """Router logits [T, E_g] float, routing fits E_g, bias [E_g] only with SIGMOID_GROUPED."""
    if not isinstance(routing, RoutingConfig):
        raise TypeError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")
    require_tensor(name, logits, ndim=2, dtypes=FLOAT_DTYPES)
    width = logits.shape[1]
    if num_global_experts is not None and width != num_global_experts:
        raise ValueError(
            f"{name}: expected shape [T, {num_global_experts}] (one logit per global expert), got {tuple(logits.shape)}"
        )
    if width < 1:
        raise ValueError(f"{name}: expected at least one expert column, got shape {tuple(logits.shape)}")
    routing.check_num_experts(width)
    if e_score_correction_bias is not None:
        if routing.scoring is not Scoring.SIGMOID_GROUPED:
            raise ValueError(
                f"e_score_correction_bias: only used by scoring=SIGMOID_GROUPED, got scoring={routing.scoring.value}"
            )
        require_tensor("e_score_correction_bias", e_score_correction_bias, ndim=1, dtypes=FLOAT_DTYPES)
        _require_shape("e_score_correction_bias", e_score_correction_bias, (width,), "one bias per expert")
        _require_device("e_score_correction_bias", e_score_correction_bias, logits.device)


def check_topk(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_tokens: int, num_global_experts: int) -> int:
    """Precomputed routing: topk_ids [T, k] int, topk_weights [T, k] float, 1 <= k <= E_g -> k."""
    require_tensor("topk_ids", topk_ids, ndim=2, dtypes=INT_DTYPES)
    require_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected {num_tokens} rows (one per token of hidden), got shape {tuple(topk_ids.shape)}")
    if not 1 <= top_k <= num_global_experts:
        raise ValueError(f"topk_ids: expected 1 <= k <= {num_global_experts} columns (top_k), got shape {tuple(topk_ids.shape)}")
    _require_shape("topk_weights", topk_weights, tuple(topk_ids.shape), "the shape of topk_ids")
    if topk_weights.device != topk_ids.device:
        raise ValueError(f"topk_weights: expected a tensor on {topk_ids.device} (the device of topk_ids), got {topk_weights.device}")
    return top_k


def check_id_values(topk_ids: torch.Tensor, num_global_experts: int, allow_unused: bool) -> None:
    """Values of topk_ids in [0, E_g) (or -1 when allow_unused). Reads values: a host sync on CUDA."""
    if topk_ids.numel() == 0:
        return
    low = -1 if allow_unused else 0
    lo, hi = (int(v) for v in torch.aminmax(topk_ids))
    if lo < low or hi >= num_global_experts:
        allowed = f"[{low}, {num_global_experts})"
        note = " (-1 only with expert_map)" if not allow_unused else " (-1 = slot unused)"
        raise ValueError(f"topk_ids: expected values in {allowed}{note}, got values in [{lo}, {hi}]")


def check_expert_map_values(expert_map: torch.Tensor, num_local_experts: int) -> None:
    """Values of expert_map in [-1, E). Reads values: a host sync on CUDA."""
    lo, hi = (int(v) for v in torch.aminmax(expert_map))
    if lo < -1 or hi >= num_local_experts:
        raise ValueError(
            f"expert_map: expected values in [-1, {num_local_experts}) (local expert id or -1), got values in [{lo}, {hi}]"
        )


def validate_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    router_logits: torch.Tensor | None,
    routing: RoutingConfig | None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    id_check: IdCheck = IdCheck.CHECK,
    num_global_experts: int | None = None,
    weight_names: tuple[str, str, str, str] = ("w13", "w2", "b13", "b2"),
    checked_weights: tuple[int, int, int, int] | None = None,
) -> MoEProblem:
    """All checks of one fused_moe call; returns the problem's shapes. id_check must be CHECK or SKIP.

    num_global_experts: E_g where no expert_map says it (expert parallelism: the rank's local weights, global ids);
    by default the experts of w13. weight_names: what the errors call w13, w2, b13 and b2. checked_weights: what
    check_weights returned for these very weights (a MoELayer checks its weights once, when it is built): their
    checks are skipped, the inputs are still checked against them."""
    if checked_weights is None:
        num_experts, intermediate, hidden_size, num_global = check_weights(w13, w2, b13, b2, expert_map, weight_names)
    else:
        if (not isinstance(checked_weights, tuple) or len(checked_weights) != 4
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in checked_weights)):
            raise ValueError(f"checked_weights: expected check_weights' result (E, I, H, E_global), got {checked_weights!r}")
        num_experts, intermediate, hidden_size, num_global = checked_weights
    if num_global_experts is not None and expert_map is None:
        num_global = num_global_experts
    n13 = weight_names[0]
    require_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D tensor [T, H], got shape {tuple(hidden.shape)}")
    if hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden: expected shape [T, {hidden_size}] (H from {n13} [E, 2I, H]), got {tuple(hidden.shape)}")
    if w13.dtype != hidden.dtype:
        raise TypeError(
            f"{n13}: expected dtype {_dtype_name(hidden.dtype)} (the dtype of hidden), got {_dtype_name(w13.dtype)}"
        )
    device = hidden.device
    if checked_weights is None:
        for name, tensor in zip(weight_names + ("expert_map",), (w13, w2, b13, b2, expert_map)):
            _require_device(name, tensor, device)
    else:  # (check_weights put every weight on w13's device)
        _require_device(weight_names[0], w13, device)
    num_tokens = hidden.shape[0]
    if routing is not None and not isinstance(routing, RoutingConfig):
        raise TypeError(f"routing: expected a RoutingConfig, got {type(routing).__name__}")

    precomputed = topk_ids is not None or topk_weights is not None
    if router_logits is not None and precomputed:
        raise ValueError("router_logits: expected either router_logits or (topk_weights, topk_ids), got both")
    if precomputed:
        if topk_ids is None or topk_weights is None:
            missing = "topk_ids" if topk_ids is None else "topk_weights"
            raise ValueError(f"{missing}: expected topk_weights and topk_ids together, got only one of them")
        top_k = check_topk(topk_weights, topk_ids, num_tokens, num_global)
        if routing is not None and routing.top_k != top_k:
            raise ValueError(f"topk_ids: expected {routing.top_k} columns (routing.top_k), got shape {tuple(topk_ids.shape)}")
        _require_device("topk_ids", topk_ids, device)
        _require_device("topk_weights", topk_weights, device)
        if e_score_correction_bias is not None:
            raise ValueError("e_score_correction_bias: only used when routing from router_logits, got precomputed topk_ids")
    else:
        if router_logits is None:
            raise ValueError("router_logits: expected router_logits [T, E] or (topk_weights, topk_ids), got neither")
        if routing is None:
            raise ValueError("routing: expected a RoutingConfig to route router_logits, got None")
        check_logits(router_logits, routing, num_global, e_score_correction_bias)
        if router_logits.shape[0] != num_tokens:
            raise ValueError(
                f"router_logits: expected {num_tokens} rows (one per token of hidden), got shape {tuple(router_logits.shape)}"
            )
        _require_device("router_logits", router_logits, device)
        _require_device("e_score_correction_bias", e_score_correction_bias, device)
        top_k = routing.top_k

    if id_check is IdCheck.CHECK:
        if expert_map is not None:
            check_expert_map_values(expert_map, num_experts)
        if topk_ids is not None:
            check_id_values(topk_ids, num_global, allow_unused=expert_map is not None)
    elif id_check is not IdCheck.SKIP:
        raise ValueError(f"id_check: expected IdCheck.CHECK or IdCheck.SKIP once resolved, got {id_check!r}")
    return MoEProblem(
        num_tokens=num_tokens,
        hidden=hidden_size,
        intermediate=intermediate,
        num_experts=num_experts,
        num_global_experts=num_global,
        top_k=top_k,
        dtype=hidden.dtype,
        device=device,
        has_bias=b13 is not None or b2 is not None,
    )


def output_dir(path: str | os.PathLike, argument: str) -> pathlib.Path:
    """A directory a command will write into, made now (parents too) and checked writable: a bad path fails before
    the work that would write there, with a ValueError naming `argument`."""
    if not os.fspath(path):  # pathlib would read "" as the current directory
        raise ValueError(f"{argument}: expected a directory path, got an empty one")
    path = pathlib.Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{argument}: cannot make the directory {path} ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{argument}: the directory {path} is not writable")
    return path


def output_file(path: str | os.PathLike, argument: str) -> pathlib.Path:
    """A file a command will write (or append to) later, checked now: not a directory, its directory made and
    writable, the file itself writable if it exists. ValueError naming `argument`."""
    if not os.fspath(path):
        raise ValueError(f"{argument}: expected a file path, got an empty one")
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{argument}: {path} is a directory, expected a file path")
    output_dir(path.parent if str(path.parent) else ".", argument)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{argument}: {path} is not writable")
    return path
