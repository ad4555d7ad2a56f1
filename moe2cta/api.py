"""Public API: route, fused_moe, is_supported, MoELayer.

One forward (docs/design.md):

    router_logits [T, E_g] --route--> (topk_weights [T, k] fp32, topk_ids [T, k] int32)
      --dispatch--> padded expert-order metadata --gather--> a1 --GEMM1 + activation--> a2
      --GEMM2--> y --combine (fixed slot order, fp32)--> out [T, H] in hidden's dtype

Backends (moe2cta.config.Backend):
- TORCH: the torch twins of every stage (moe_forward_reference's pipeline); any device; reads ids back to
  the host (it is the reference, not a fast path).
- TRITON: moe2cta.router.api (Triton route / dispatch / gather / combine) + grouped_gemm.triton_grouped_gemm
  (GEMM1 reads the token rows directly through `a_rows`, no gathered copy). Batches of a few tokens
  (grouped_gemm.triton_token_gemv.token_gemv_applies, or MoELayer's token_gemv_max_tokens) skip dispatch,
  grouped GEMMs and combine: route, then the token GEMVs' two launches (GEMV1 + activation per slot, GEMV2
  + the fixed-order combine per token) straight from topk_ids. CUDA; on CPU only with TRITON_INTERPRET=1
  set and backend chosen explicitly (tests).
- CUTE: Triton router + the CuTe DSL grouped GEMMs (sm90_grouped_gemm on sm_90, sm100_grouped_gemm on
  sm_100) on w13 prepacked once (MoELayer) for the fused activation.
- AUTO: on sm_90 with both GPU backends supported, a BackendPlan: TRITON for batches of fewer tokens than the
  token GEMVs take for the layer's expert size (auto_triton_max_tokens: 1-7 tokens for small experts, none for
  mixtral-size ones), CUTE for every larger batch, both reading one packed copy of w13 (W13Layout.CHUNKED).
  Elsewhere TRITON if supported, else CUTE, else TORCH. Each step down is explained in `MoELayer.backend_reason`.
  An explicitly requested backend that cannot run the problem raises ValueError with is_supported's reason.

Hot path: for TRITON / CUTE on CUDA, fused_moe and MoELayer.__call__ do no host sync: validation reads
shapes, dtypes and devices only (IdCheck.AUTO skips the value range check of topk_ids there), and every
buffer is sized from T, k, E and align.

NaN / inf router logits (defined by the router twin, router/reference.py; nothing scans for them, that
would need a sync): selection treats NaN as lower than every number, ties go to the lower expert index, and
no token's NaN reaches another token. SOFTMAX: a NaN or +inf logit makes that token's softmax row NaN, so
the token takes experts 0..k-1 with NaN weights and its output row is NaN. TOPK_SOFTMAX, SIGMOID_TOP1,
SIGMOID_GROUPED: a NaN expert is never chosen while k numbers remain and the weights stay finite, except
+inf under TOPK_SOFTMAX (NaN weights for that token). -inf logits are ordinary (probability 0). NaN / inf in
hidden or the weights propagate through the arithmetic like in any matmul.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import warnings

import torch

from . import tuning
from .config import Backend, Gemm1Input, IdCheck, MoEConfig, parse_w13_layout
from .grouped_gemm import Activation, GemmStage
from .grouped_gemm.epilogue import GATE_UP_CHUNK, W13Layout, pack_gate_up_rows, unpack_gate_up_rows
from .reference import RouterWeightOn, moe_forward_reference
from .router import GatherPadding, RoutingConfig, Scoring
from .router.config import triton_interpreting
from .router.reference import max_rows_for, route_reference
from .validation import (
    FLOAT_DTYPES,
    MoEProblem,
    check_logits,
    check_weights,
    require_tensor,
    validate_moe,
)

__all__ = ["route", "fused_moe", "is_supported", "MoELayer", "BackendPlan", "auto_triton_max_tokens"]

# Limits of the Triton router kernels, used when router/routing_triton.py does not state its own.
TRITON_ROUTER_MAX_EXPERTS = 512
TRITON_ROUTER_MAX_TOP_K = 16
# CuTe GEMM families: H a multiple of the 64-element K tile (GEMM1 reading the token rows copies whole 64-column
# slices); I a multiple of 8 on sm_90 (GEMM1's N = 2I in whole gate / up chunk pairs: the regular kernel takes a
# partial last n-block, and TMA zero-fills GEMM2's partial last K tile) and of 64 on sm_100; pair tiles need expert
# row blocks that are multiples of 128 rows.
CUTE_DIM_MULTIPLE = 64
CUTE_ARCH_MODULES = {(9, 0): "sm90_grouped_gemm", (10, 0): "sm100_grouped_gemm"}
CUTE_INTERMEDIATE_MULTIPLE = {(9, 0): 8, (10, 0): 64}
CUTE_ALIGN_MULTIPLE = 128
# the reason _layer_support gives where CUTE has neither the DSL nor a bundle that can serve this version
NO_CUTE_KERNELS = "neither the CuTe DSL compiler nor a kernel bundle is available"
# AUTO on sm_90 (auto_triton_max_tokens): TRITON only where its token GEMVs beat the CuTe decode kernels, CUTE for
# every other batch. Measured on the H200 (serving_bench/results/auto-decode-h200-2026-12-01/, T = 1..32, two runs in
# both orders): the token GEMVs win below their own token limit (qwen3-30b-a3b T <= 6 of 8: 0.74-0.98 of CUTE's time;
# qwen3-235b-a22b T <= 3 of 4; deepseek-v3 and gpt-oss-120b T = 1 of 2) and tie or lose at it (0.96-1.00); above
# it CUTE's swapped / wide decode kernels tie or beat Triton's grouped GEMMs (0.93-1.02 at T = 2..32; full grid v19 /
# v20: gpt-oss T=512 -6..-7%, mixtral T=128 -3..-5%, qwen3-30b T=8 / 32 -3..-4%). Before, AUTO ran TRITON up to 32
# rows per expert (layer v12).
# Where AUTO splits by batch size: the CuTe family and the device kinds on which the split was measured.
AUTO_SPLIT_CAPABILITIES = ((9, 0),)


@dataclasses.dataclass(frozen=True)
class BackendPlan:
    """Which backend runs a batch of a layer: `decode` for batches of at most `decode_max_tokens` tokens and at
    most `decode_max_rows_per_expert` routed rows per expert (T * top_k / E_g; both host-side counts: no sync),
    `prefill` for the others. One backend for every batch: decode == prefill (both limits infinite)."""

    decode: Backend
    prefill: Backend
    decode_max_rows_per_expert: float = math.inf
    decode_max_tokens: float = math.inf

    def __post_init__(self):
        for name in ("decode", "prefill"):
            if not isinstance(getattr(self, name), Backend):
                raise TypeError(f"{name}: expected a Backend, got {getattr(self, name)!r}")
        for name in ("decode_max_rows_per_expert", "decode_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}: expected a number >= 0 (math.inf: no limit), got {value!r}")

    @classmethod
    def single(cls, backend: Backend) -> "BackendPlan":
        return cls(backend, backend)

    @property
    def backends(self) -> tuple[Backend, ...]:
        return (self.decode,) if self.decode is self.prefill else (self.decode, self.prefill)

    def for_batch(self, num_tokens: int, top_k: int, num_global_experts: int) -> Backend:
        rows_per_expert = num_tokens * top_k / max(1, num_global_experts)
        decode_sized = num_tokens <= self.decode_max_tokens and rows_per_expert <= self.decode_max_rows_per_expert
        return self.decode if decode_sized else self.prefill


# ---------------------------------------------------------------------------------------------------------
# Optional modules, imported when first needed (never at package import).


@functools.lru_cache(maxsize=None)
def _optional_module(name: str):
    """(module, "") or (None, reason) for moe2cta.<name>; a missing or broken module is a reason, not a crash."""
    try:
        return importlib.import_module(f"moe2cta.{name}"), ""
    except ModuleNotFoundError as exc:
        return None, f"module moe2cta.{name} is not available ({exc})"
    except Exception as exc:  # noqa: BLE001 - a broken optional backend must not break the torch path
        return None, f"module moe2cta.{name} failed to import ({type(exc).__name__}: {exc})"


def _router_api():
    module, reason = _optional_module("router.api")
    if module is None:
        raise RuntimeError(reason)
    return module


def _triton_router_backend():
    return _router_api().RouterBackend.TRITON


def _interpreter_on() -> bool:
    return triton_interpreting()


# ---------------------------------------------------------------------------------------------------------
# Support checks.


def _layer_support(
    backend: Backend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    hidden: int,
    intermediate: int,
    num_experts: int,
    num_global_experts: int,
    config: MoEConfig,
    w13_layout: W13Layout = W13Layout.GATE_THEN_UP,
) -> tuple[bool, str]:
    """Whether `backend` (not AUTO) can run a layer with these static facts; the reason names what is off.
    w13_layout: the row order the Triton GEMM1 reads (the CuTe families always read CHUNKED)."""
    if backend is Backend.TORCH:
        return True, ""
    name = backend.value
    if backend is Backend.TRITON:
        if device.type != "cuda" and not (device.type == "cpu" and _interpreter_on()):
            return False, f"{name}: needs a CUDA device (or TRITON_INTERPRET=1 on CPU), tensors are on {device}"
        if dtype not in FLOAT_DTYPES:
            return False, f"{name}: dtype {dtype} not supported"
    else:  # CUTE
        if device.type != "cuda":
            return False, f"{name}: needs a CUDA sm_90 / sm_100 device, tensors are on {device}"
        capability = torch.cuda.get_device_capability(device)
        if capability not in CUTE_ARCH_MODULES:
            return False, f"{name}: needs sm_90 or sm_100, device is sm_{capability[0]}{capability[1]}"
        if dtype not in (torch.bfloat16, torch.float16):
            return False, f"{name}: needs bfloat16 or float16 tensors, got {dtype}"
        for label, size, multiple in (("hidden size H", hidden, CUTE_DIM_MULTIPLE),
                                      ("intermediate size I", intermediate, CUTE_INTERMEDIATE_MULTIPLE[capability])):
            if size % multiple:
                return False, f"{name}: {label}={size} is not a multiple of {multiple}"
        if config.align % CUTE_ALIGN_MULTIPLE:
            return False, f"{name}: align={config.align} is not a multiple of {CUTE_ALIGN_MULTIPLE}"
        module, reason = _optional_module(f"grouped_gemm.{CUTE_ARCH_MODULES[capability]}")
        if module is None:
            return False, f"{name}: {reason}"
        ok, reason = _cute_family_support(module, dtype, hidden, intermediate, num_experts, config)
        if not ok:
            return False, f"{name}: {reason}"
        runtime, reason = _optional_module("grouped_gemm.cute_runtime")
        if runtime is None:
            return False, f"{name}: {reason}"
        if not runtime.dsl_available():
            directory = runtime.kernel_dir()
            problem = runtime.bundle_dir_problem(directory)
            if problem is None:  # a bundle this version cannot load from (another version's sources, another arch)
                family = getattr(module, "FAMILY", module.__name__.rsplit(".", 1)[-1])
                problem = runtime.bundle_provenance_problem(directory, family)
            if problem is not None:
                return False, f"{name}: {NO_CUTE_KERNELS} ({problem})"
    # Both GPU backends route, dispatch, gather and combine with the Triton router kernels.
    router, reason = _optional_module("router.api")
    if router is None:
        return False, f"{name}: {reason}"
    kernels, reason = _optional_module("router.routing_triton")
    if kernels is None:
        return False, f"{name}: {reason}"
    max_experts = getattr(kernels, "MAX_EXPERTS", TRITON_ROUTER_MAX_EXPERTS)
    max_top_k = getattr(kernels, "MAX_TOP_K", TRITON_ROUTER_MAX_TOP_K)
    if max(num_global_experts, num_experts) > max_experts:
        return False, f"{name}: the Triton router handles up to {max_experts} experts, got {num_global_experts}"
    routing = config.routing
    if routing is not None and routing.top_k > max_top_k:
        return False, f"{name}: the Triton router handles top_k up to {max_top_k}, got {routing.top_k}"
    if backend is Backend.TRITON:
        gemm, reason = _optional_module("grouped_gemm.triton_grouped_gemm")
        if gemm is None:
            return False, f"{name}: {reason}"
        rows = max(1, num_experts)  # bucket of one row per expert: a static, representative problem
        for stage, n, k in ((GemmStage.GEMM1, intermediate, hidden), (GemmStage.GEMM2, hidden, intermediate)):
            problem = gemm.GroupedGemmProblem(stage, num_experts, n, k, rows, dtype, tuple(config.tile_heights),
                                              w13_layout=w13_layout)
            ok, why = gemm.can_implement(gemm.default_config(problem), problem)
            if not ok:
                return False, f"{name}: {stage.value} (N={n}, K={k}): {why}"
    return True, ""


def _cute_family_support(module, dtype, hidden, intermediate, num_experts, config: MoEConfig) -> tuple[bool, str]:
    """Ask the arch's CuTe family (its default_config + can_implement) about both GEMMs of the layer."""
    family = module.__name__.rsplit(".", 1)[-1]
    prefix = family.split("_", 1)[0]
    for function in (f"{prefix}_grouped_gemm1", f"{prefix}_grouped_gemm2"):
        if not callable(getattr(module, function, None)):
            return False, f"{family} has no {function} yet"
    has_bias = False  # biases do not change which tiles fit
    if prefix == "sm90":
        problems = (
            module.Sm90Problem(GemmStage.GEMM1, 2 * intermediate, hidden, num_experts, dtype, config.activation, has_bias),
            module.Sm90Problem(GemmStage.GEMM2, hidden, intermediate, num_experts, dtype, None, has_bias),
        )
    else:
        dtype_name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        problems = (
            module.Sm100Problem(GemmStage.GEMM1, 2 * intermediate, hidden, num_experts, dtype_name, config.activation),
            module.Sm100Problem(GemmStage.GEMM2, hidden, intermediate, num_experts, dtype_name),
        )
    for label, problem in zip(("gemm1", "gemm2"), problems):
        try:
            ok, why = module.can_implement(module.default_config(problem), problem)
        except ValueError as exc:
            ok, why = False, str(exc)
        if not ok:
            return False, f"{family} {label}: {why}"
    return True, ""


def auto_triton_max_tokens(expert_bytes: int, token_gemv_max_tokens: int | None = None) -> int:
    """The largest batch (tokens) that AUTO runs on TRITON where it splits (sm_90): one token below the token GEMVs'
    limit for experts of `expert_bytes` weight bytes (grouped_gemm.triton_token_gemv.token_gemv_max_tokens; measured:
    see the comment above BackendPlan), 0 where they take no batch; a layer's explicit token_gemv_max_tokens as
    given."""
    if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, int) or expert_bytes < 0:
        raise ValueError(f"expert_bytes: expected an int >= 0 (one expert's weight bytes), got {expert_bytes!r}")
    if token_gemv_max_tokens is not None:
        if isinstance(token_gemv_max_tokens, bool) or not isinstance(token_gemv_max_tokens, int) or (
                token_gemv_max_tokens < 0):
            raise ValueError(f"token_gemv_max_tokens: expected an int >= 0 or None, got {token_gemv_max_tokens!r}")
        return token_gemv_max_tokens
    gemv, _ = _optional_module("grouped_gemm.triton_token_gemv")
    if gemv is None:
        return 0
    return max(0, gemv.token_gemv_max_tokens(expert_bytes) - 1)


def _expert_bytes(hidden: int, intermediate: int, dtype: torch.dtype, biases=()) -> int:
    """Weight bytes of one expert (w13 + w2, plus one row of each bias tensor in `biases`, None entries skipped):
    what the token GEMVs' limits are set by."""
    return 3 * hidden * intermediate * dtype.itemsize + sum(b.shape[1] * b.element_size() for b in biases
                                                            if b is not None)


def _select_backend(requested: Backend, *, expert_bytes: int | None = None, token_gemv_max_tokens: int | None = None,
                    **facts) -> tuple[BackendPlan, str]:
    """Resolve AUTO and explain; an explicit unsupported backend raises ValueError.

    AUTO on sm_90 with both GPU backends supported: TRITON for batches of at most auto_triton_max_tokens tokens
    (`expert_bytes`: one expert's weight bytes, by default w13 + w2 from the facts; `token_gemv_max_tokens`: the
    layer's explicit token-GEMV limit), CUTE above (measured there: see the comment above BackendPlan). Elsewhere
    TRITON -> CUTE -> TORCH, the first that runs the layer: TRITON first because it is the faster layer at decode
    sizes off sm_90's CuTe kernels, and sm_100 CuTe kernels have not been measured on a GPU.
    """
    if requested is not Backend.AUTO:
        ok, reason = _layer_support(requested, **facts)
        if not ok:
            raise ValueError(f"backend: {requested.value} cannot run this layer: {reason}")
        return BackendPlan.single(requested), f"{requested.value}: requested"
    skipped = []
    supported = []
    for candidate in (Backend.TRITON, Backend.CUTE):
        if candidate is Backend.TRITON and facts["device"].type != "cuda":
            skipped.append(f"triton: needs a CUDA device, tensors are on {facts['device']}")
            continue
        ok, reason = _layer_support(candidate, **facts)
        if ok:
            supported.append(candidate)
        else:
            skipped.append(reason)
            if candidate is Backend.CUTE:
                _warn_configured_bundle_refused(reason)
    if supported == [Backend.TRITON, Backend.CUTE] and (
            torch.cuda.get_device_capability(facts["device"]) in AUTO_SPLIT_CAPABILITIES) and (
            _layer_support(Backend.TRITON, **{**facts, "w13_layout": W13Layout.CHUNKED})[0]):  # the shared packed w13
        if expert_bytes is None:
            expert_bytes = _expert_bytes(facts["hidden"], facts["intermediate"], facts["dtype"])
        most = auto_triton_max_tokens(expert_bytes, token_gemv_max_tokens)
        plan = BackendPlan(Backend.TRITON, Backend.CUTE, decode_max_tokens=most)
        return plan, (f"auto -> triton up to {most} tokens (its token GEMVs), cute above; both on one packed w13")
    if supported:
        return BackendPlan.single(supported[0]), "; ".join(skipped + [f"auto -> {supported[0].value}"])
    return BackendPlan.single(Backend.TORCH), "; ".join(skipped + ["auto -> torch"])


_WARNED_BUNDLE_REASONS: set[str] = set()


def _warn_configured_bundle_refused(reason: str) -> None:
    """A deployment that names a kernel bundle (MOE2CTA_KERNEL_DIR) on a machine without the CuTe DSL expects the
    CuTe kernels; where the bundle cannot serve them (stale, another version, mistyped), AUTO plans the slower Triton
    kernels. That is said here as a RuntimeWarning, once per reason and process (fused_moe plans on every call), not
    only in MoELayer.backend_reason."""
    if NO_CUTE_KERNELS not in reason or reason in _WARNED_BUNDLE_REASONS:
        return
    runtime, _ = _optional_module("grouped_gemm.cute_runtime")
    if runtime is not None and runtime.kernel_dir() is not None:
        _WARNED_BUNDLE_REASONS.add(reason)
        warnings.warn(f"moe2cta: backend AUTO plans without the CuTe kernels: {reason}", RuntimeWarning, stacklevel=3)


def is_supported(
    backend: Backend | str,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    routing: RoutingConfig | None = None,
    activation: Activation | str = Activation.SWIGLU,
    router_weight_on: RouterWeightOn | str = RouterWeightOn.OUTPUT,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    align: int = 128,
) -> tuple[bool, str]:
    """(True, "") if `backend` can run this layer, else (False, reason). AUTO: (True, the choice) for every layer
    some backend runs.

    Malformed inputs are not a support question: they raise ValueError / TypeError as in fused_moe (shapes, a
    routing whose top_k exceeds the experts). A hidden of another dtype or device than w13, which no backend runs, is
    answered (False, reason) for every backend, AUTO included.
    """
    backend = Backend.parse(backend)
    config = MoEConfig(routing, activation, router_weight_on, align)
    num_experts, intermediate, hidden_size, num_global = check_weights(w13, w2, b13, b2, expert_map)
    if routing is not None:
        routing.check_num_experts(num_global)
    require_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    if hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden: expected shape [T, {hidden_size}] (H from w13 [E, 2I, H]), got {tuple(hidden.shape)}")
    if hidden.dtype != w13.dtype:
        return False, f"{backend.value}: hidden is {hidden.dtype} but w13 is {w13.dtype}"
    if hidden.device != w13.device:
        return False, f"{backend.value}: hidden is on {hidden.device} but w13 is on {w13.device}"
    facts = dict(
        dtype=hidden.dtype,
        device=hidden.device,
        hidden=hidden_size,
        intermediate=intermediate,
        num_experts=num_experts,
        num_global_experts=num_global,
        config=config,
    )
    if backend is Backend.AUTO:
        _, reason = _select_backend(Backend.AUTO, **facts)
        return True, reason
    return _layer_support(backend, **facts)


# ---------------------------------------------------------------------------------------------------------
# Routing.


def route(
    logits: torch.Tensor,
    routing: RoutingConfig,
    e_score_correction_bias: torch.Tensor | None = None,
    *,
    backend: Backend | str = Backend.AUTO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int32). Ties: lower expert index wins.

    AUTO: the Triton router on CUDA when moe2cta.router.api is present, else the torch twin. CUTE routes
    with the Triton router (it has no router of its own).
    """
    backend = Backend.parse(backend)
    check_logits(logits, routing, None, e_score_correction_bias, name="logits")
    if backend is Backend.AUTO:
        use_triton = logits.device.type == "cuda" and _optional_module("router.api")[0] is not None
        backend = Backend.TRITON if use_triton else Backend.TORCH
    if backend is Backend.TORCH:
        return route_reference(logits, routing, e_score_correction_bias)
    if logits.device.type != "cuda" and not _interpreter_on():
        raise ValueError(f"backend: {backend.value} routes on CUDA (or TRITON_INTERPRET=1), logits are on {logits.device}")
    api = _router_api()
    return api.route(logits, routing, e_score_correction_bias, backend=_triton_router_backend())


# ---------------------------------------------------------------------------------------------------------
# Backend adapters: (layer, hidden, topk_weights, topk_ids, dispatch) -> out [T, H]. TORCH gets fp32 weights and int32
# ids; the kernel backends get them as the caller passed them (any float dtype; int32 / int64), contiguous.


def _forward_torch(layer: "MoELayer", hidden, topk_weights, topk_ids, disp=None):
    del disp  # the twin pipeline builds its own dispatch
    config = layer.config
    # The twin reads the public layout; a layer handed a packed w13 unpacks it per call (a temporary, so the
    # layer still holds one copy).
    w13 = layer.w13 if layer.w13_layout is W13Layout.GATE_THEN_UP else unpack_gate_up_rows(layer.w13)
    return moe_forward_reference(
        hidden,
        w13,
        layer.w2,
        None,
        config.routing,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=config.activation,
        b13=layer.b13,
        b2=layer.b2,
        expert_map=layer.expert_map,
        router_weight_on=config.router_weight_on,
        align=config.align,
    )


def _dispatch_gpu(layer: "MoELayer", topk_ids):
    config = layer.config
    return _router_api().dispatch(
        topk_ids,
        layer.num_experts,
        align=config.align,
        tile_heights=tuple(config.tile_heights),
        expert_map=layer.expert_map,
        backend=_triton_router_backend(),
    )


def _route_dispatch_gpu(layer: "MoELayer", router_logits):
    """Routing and dispatch in one call (one launch for small T) -> (topk_weights, topk_ids, disp)."""
    config = layer.config
    return _router_api().route_dispatch(
        router_logits,
        config.routing,
        layer.num_experts,
        e_score_correction_bias=layer.e_score_correction_bias,
        align=config.align,
        tile_heights=tuple(config.tile_heights),
        expert_map=layer.expert_map,
        backend=_triton_router_backend(),
    )


def _combine_gpu(layer: "MoELayer", y, disp, topk_weights, hidden):
    api = _router_api()
    weights = topk_weights if layer.config.router_weight_on is RouterWeightOn.OUTPUT else None
    top_k = topk_weights.shape[1]
    return api.combine(y, disp, weights, hidden.shape[0], top_k, out_dtype=hidden.dtype, backend=_triton_router_backend())


def _kernel_w13(layer: "MoELayer") -> tuple[torch.Tensor, W13Layout]:
    """The w13 the Triton kernels read, and its layout: the packed w13 of a layer that also runs CUTE (or was
    handed w13 packed), else w13 as given. Both Triton kernel families read either layout."""
    packed = layer.prepared.get("packed_w13")
    if packed is not None:
        return packed, W13Layout.CHUNKED
    return layer.w13, layer.w13_layout


def _forward_triton_tokens(layer: "MoELayer", hidden, topk_weights, topk_ids):
    """A batch of a few tokens: GEMV1 per (token, expert) slot, then GEMV2 with the combine, from topk_ids."""
    gemv = layer._token_gemv  # the module, looked up once when the layer was built
    on_input = layer.config.router_weight_on is RouterWeightOn.INPUT
    w13, layout = _kernel_w13(layer)
    a2 = gemv.token_gemv1(hidden, topk_ids, w13, layer.config.activation, b13=layer.b13,
                          topk_weights=topk_weights if on_input else None, expert_map=layer.expert_map,
                          w13_layout=layout)
    return gemv.token_gemv2_combine(a2, topk_ids, layer.w2, None if on_input else topk_weights, b2=layer.b2,
                                    expert_map=layer.expert_map, out_dtype=hidden.dtype)


def _forward_triton(layer: "MoELayer", hidden, topk_weights, topk_ids, disp):
    gemm = _optional_module("grouped_gemm.triton_grouped_gemm")[0]
    config = layer.config
    top_k = topk_ids.shape[1]
    if config.router_weight_on is RouterWeightOn.INPUT:
        # The weight scales the token before the expert: materialize the scaled rows once.
        a = _router_api().gather(hidden, disp, top_k, scale=topk_weights, backend=_triton_router_backend())
        a_rows = None
    else:
        # Fused gather: GEMM1 reads token rows hidden[slot // k] straight from the dispatch's sorted slots
        # (-1 = padding loads zeros): no index tensor is built.
        a = hidden
        a_rows = disp.sorted_slots
    heights = tuple(disp.tile_heights)
    w13, layout = _kernel_w13(layer)
    a2 = gemm.triton_grouped_gemm1(
        a, w13, disp.row_offsets, disp.counts, disp.tile_offsets, config.activation,
        b13=layer.b13, a_rows=a_rows, tile_heights=heights, a_rows_per_source=top_k if a_rows is not None else 1,
        w13_layout=layout, align=disp.align,
    )
    y = gemm.triton_grouped_gemm2(
        a2, layer.w2, disp.row_offsets, disp.counts, disp.tile_offsets, b2=layer.b2, tile_heights=heights,
        align=disp.align,
    )
    return _combine_gpu(layer, y, disp, topk_weights, hidden)


def _prepare_cute(layer: "MoELayer") -> dict:
    """w13 in W13Layout.CHUNKED (for the fused activation): packed once here from the public layout (a second
    copy beside the caller's), or the caller's own tensor when the layer was handed it packed (no copy).
    The biases in the CuTe epilogue's layout (fp32, b13 interleaved like w13; a few MB for gpt-oss-120b), made
    here once: converting them per forward cost gpt-oss-120b three copy launches, ~12 us (H200 profile). The
    Triton kernels read the public b13 / b2 as they are."""
    capability = torch.cuda.get_device_capability(layer.w13.device)
    module = _optional_module(f"grouped_gemm.{CUTE_ARCH_MODULES[capability]}")[0]
    packed = layer.w13 if layer.w13_layout is W13Layout.CHUNKED else pack_gate_up_rows(layer.w13)
    # the per-device tensors the launches pass and never read, made now (outside any graph capture's memory pool)
    module.prepare_device(layer.w13.device)
    prepared = {
        "module": module,
        "packed_w13": packed,
        "b13": None if layer.b13 is None else module.kernel_bias(GemmStage.GEMM1, layer.b13),
        "b2": None if layer.b2 is None else module.kernel_bias(GemmStage.GEMM2, layer.b2),
    }
    if hasattr(module, "default_overrides_tuning"):  # sm90: the layer's two GEMM problems, for the tuning lookup
        on_input = layer.config.router_weight_on is RouterWeightOn.INPUT
        prepared["problems"] = (
            module.Sm90Problem(GemmStage.GEMM1, 2 * layer.intermediate, layer.hidden_size, layer.num_experts,
                               layer.w13.dtype, layer.config.activation, layer.b13 is not None),
            module.Sm90Problem(GemmStage.GEMM2, layer.hidden_size, layer.intermediate, layer.num_experts,
                               layer.w13.dtype, None, layer.b2 is not None, not on_input),
        )
        prepared["class_bounds"] = module.class_bounds(layer.w13.device)  # (expert classes; made outside any capture)
    return prepared


CUTE_PLANS_KEPT = 256  # batch sizes whose CUTE host choices a layer keeps (MoELayer._cute_plan)


@dataclasses.dataclass(frozen=True)
class _CutePlan:
    """The host-side choices of one CUTE forward, which depend on the batch only through (T, k): made once per
    (T, k) and layer (MoELayer._cute_plan), not per forward."""

    prefix: str  # the family's entry points: {prefix}_grouped_gemm1 / 2 ("sm90" or "sm100")
    rows_per_expert: float
    hint: dict  # sm90: rows_per_expert for the family default; sm100: nothing
    cfg1: object  # tuned configurations (None: the family default)
    cfg2: object
    token_rows_cfg: object  # sm90 GEMM1 reading the token rows itself, or None (a gather launch first)
    classes1: tuple  # sm90 expert classes (one launch each) of GEMM1 / GEMM2; () = one launch
    classes2: tuple
    padding: GatherPadding


def _make_cute_plan(layer: "MoELayer", num_tokens: int, top_k: int) -> _CutePlan:
    prepared = layer.prepared
    module = prepared["module"]
    prefix = "sm90" if module.__name__.endswith("sm90_grouped_gemm") else "sm100"
    config = layer.config
    on_input = config.router_weight_on is RouterWeightOn.INPUT
    rows_per_expert = num_tokens * top_k / max(1, layer.num_global_experts)
    # Tuned kernel configurations for this batch's bucket (host-only lookup; None = the family default).
    cfg1, cfg2, _ = tuning.kernel_configs_for_layer(
        "sm_90a" if prefix == "sm90" else "sm_100a", layer.hidden_size, layer.intermediate, layer.num_experts,
        top_k, num_tokens, config.activation, layer.b13 is not None, layer.w13.dtype, layer.tuning_cache,
        gemm2_row_scale=not on_input,
    )
    # sm90: the family default for the batch's average rows per expert where it is a swapped-operand kernel or the
    # tuned kernel itself (_sm90_tuned_configs)
    hint = {}
    token_rows_cfg = None
    if prefix == "sm90":
        hint["rows_per_expert"] = rows_per_expert
        cfg1, cfg2 = _sm90_tuned_configs(module, prepared["problems"], (cfg1, cfg2), rows_per_expert)
        wanted = layer.gemm1_input is Gemm1Input.TOKEN_ROWS or (
            layer.gemm1_input is Gemm1Input.AUTO and module.token_rows_pays(prepared["problems"][0], rows_per_expert))
        if wanted and not on_input and num_tokens > 0:
            token_rows_cfg = _token_rows_config(module, prepared["problems"][0], cfg1, rows_per_expert)
    # the launches' output rows (the dispatch's padded rows): a WEIGHTS_AS_M kernel chosen here, not by the wrappers'
    # config_for_rows, must keep its 32-bit store offsets in range too (else the regular kernel's one launch)
    out_rows = max_rows_for(num_tokens, top_k, layer.num_experts, config.align)
    if token_rows_cfg is not None and not module.direct_store_fits(token_rows_cfg, prepared["problems"][0], out_rows):
        token_rows_cfg = None
    # sm90 expert classes (default configurations only): one launch per class of experts by their rows, each with
    # the counts of its own experts (module.class_counts, on the device); () = one launch
    classes1 = classes2 = ()
    if prefix == "sm90" and cfg1 is None and cfg2 is None and num_tokens > 0:
        classes1 = () if token_rows_cfg is not None else module.expert_classes(prepared["problems"][0], rows_per_expert)
        classes2 = module.expert_classes(prepared["problems"][1], rows_per_expert)
        classes1, classes2 = (
            classes if all(module.direct_store_fits(c.config, problem, out_rows) for c in classes) else ()
            for classes, problem in ((classes1, prepared["problems"][0]), (classes2, prepared["problems"][1])))
    padding = GatherPadding.LEAVE
    if prefix == "sm90" and token_rows_cfg is None:  # (with classes: the regular kernel's, the last class)
        padding = sm90_gather_padding(module, prepared["problems"][0], classes1[-1].config if classes1 else cfg1,
                                      rows_per_expert)
    return _CutePlan(prefix, rows_per_expert, hint, cfg1, cfg2, token_rows_cfg, tuple(classes1), tuple(classes2), padding)


def _forward_cute(layer: "MoELayer", hidden, topk_weights, topk_ids, disp):
    prepared = layer.prepared
    module = prepared["module"]
    config = layer.config
    top_k = topk_ids.shape[1]
    on_input = config.router_weight_on is RouterWeightOn.INPUT
    plan = layer._cute_plan(hidden.shape[0], top_k)
    gemm1 = getattr(module, f"{plan.prefix}_grouped_gemm1")
    gemm2 = getattr(module, f"{plan.prefix}_grouped_gemm2")
    hint = plan.hint
    # GEMM2's row scale: the router weight of each row's slot, written by the gather launch (padding rows: any
    # value, never read); combine then sums the k rows of a token in fixed order without weights
    row_scale = None if on_input else torch.empty(disp.sorted_slots.shape[0], dtype=torch.float32, device=hidden.device)
    router = _router_api()
    classes1, classes2 = plan.classes1, plan.classes2
    counts_by_class = module.class_counts(disp.counts, prepared["class_bounds"]) if classes1 or classes2 else None
    if plan.token_rows_cfg is not None:
        # GEMM1 reads the token rows itself (ASource.TOKEN_ROWS): no gather launch; one small launch writes GEMM2's
        # row scale (the gather's other output)
        router.scatter_row_weights(topk_weights, disp, row_scale, backend=_triton_router_backend(), top_k=top_k)
        a2 = gemm1(hidden.contiguous(), prepared["packed_w13"], disp.row_offsets, disp.counts, config.activation,
                   b13=prepared["b13"], config=plan.token_rows_cfg, a_rows=disp.sorted_slots, rows_per_token=top_k)
    else:
        a1 = router.gather(
            hidden, disp, top_k, scale=topk_weights if on_input else None, backend=_triton_router_backend(),
            slot_weights=None if on_input else topk_weights, row_weights_out=row_scale, padding=plan.padding,
        )
        a2 = None
        for c, expert_class in enumerate(classes1):
            a2 = gemm1(a1, prepared["packed_w13"], disp.row_offsets, counts_by_class[c], config.activation,
                       b13=prepared["b13"], config=expert_class.config, out=a2)
        if not classes1:
            a2 = gemm1(a1, prepared["packed_w13"], disp.row_offsets, disp.counts, config.activation,
                       b13=prepared["b13"], config=plan.cfg1, **hint)
    y = None
    for c, expert_class in enumerate(classes2):
        y = gemm2(a2, layer.w2, disp.row_offsets, counts_by_class[c], row_scale=row_scale, b2=prepared["b2"],
                  config=expert_class.config, out=y)
    if not classes2:
        y = gemm2(a2, layer.w2, disp.row_offsets, disp.counts, row_scale=row_scale, b2=prepared["b2"],
                  config=plan.cfg2, **hint)
    return _router_api().combine(
        y, disp, None, hidden.shape[0], top_k, out_dtype=hidden.dtype, backend=_triton_router_backend()
    )


def sm90_gather_padding(module, problem, config, rows_per_expert):
    """What the gather writes into the padding rows of A for the sm90 GEMM1 `config` (None: the family default for
    `rows_per_expert`): a token row's copy where the regular (TOKENS_AS_M) kernel runs, which multiplies whole 128-row
    m-blocks (up to 127 padding rows each) and runs 3-7% faster on activation-like padding than on the zeros of a
    fresh buffer (results/padding-modes-h200-2026-12-01/); nothing (LEAVE) for the swapped-operand kernels, which load
    only the TMA boxes that hold valid rows (the wide tiles at most 31 padding rows per tile) and store none of them."""
    config = config or module.default_config(problem, rows_per_expert=rows_per_expert)
    if config.operands is module.Operands.TOKENS_AS_M:
        return GatherPadding.TOKEN_ROW
    return GatherPadding.LEAVE


def _sm90_tuned_configs(module, problems, tuned, rows_per_expert):
    """(gemm1, gemm2) configs the sm90 layer passes on, from the tuning cache's (None: the family default).

    Both fall back to the default where that is a swapped-operand kernel (`moe2cta tune` has none; its entries
    there hold a regular kernel that the swapped one was measured to beat, docs/perf-notes-sm90.md v5, v9). A
    tuned entry that is the very kernel the default runs for this batch becomes None too, so that GEMM1 reads the
    token rows where that pays, as the untuned layer does (`moe2cta tune` times its candidates on the gathered
    copy). Host work only (memoized defaults, two key comparisons), no GPU work."""
    if any(module.default_overrides_tuning(p, rows_per_expert) for p in problems):
        return None, None

    def is_default(cfg, problem):  # the same compiled kernel, run with the same runtime arguments
        default = module.default_config(problem, rows_per_expert=rows_per_expert)
        return module.kernel_key(cfg, problem) == module.kernel_key(default, problem) and (
            cfg.work_unit is module.WorkUnit.SINGLE or cfg.pair_threshold == default.pair_threshold)

    return tuple(None if cfg is None or is_default(cfg, p) else cfg for cfg, p in zip(tuned, problems))


def _token_rows_config(module, problem, tuned, rows_per_expert):
    """sm90 GEMM1 reading the token rows (ASource.TOKEN_ROWS), or None: the default configuration with its A read
    from the token rows when it is the regular kernel (SINGLE units, COOPERATIVE consumers, tile_k a multiple of 64
    dividing H) or a wide tile (160 / 288 token rows: the default at 96-256 rows per expert), not a decode tile. A
    tuned configuration (`moe2cta tune` times candidates on the gathered copy, and its bundles hold those kernels
    only) keeps the gathered copy: None."""
    if tuned is not None:
        return None
    default = module.default_config(problem, rows_per_expert=rows_per_expert)  # (memoized: nothing built per forward)
    if default.operands is module.Operands.TOKENS_AS_M:
        return module.token_rows_config(problem, rows_per_expert)
    return module.token_rows_twin(default, problem)


_FORWARD = {Backend.TORCH: _forward_torch, Backend.TRITON: _forward_triton, Backend.CUTE: _forward_cute}


# ---------------------------------------------------------------------------------------------------------
# The layer.


class MoELayer:
    """The routed-experts part of one MoE layer: weights prepared once for the chosen backend.

    w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], optional biases b13 [E, 2I], b2 [E, H],
    e_score_correction_bias [E_g] (DeepSeek-V3 routing), expert_map [E_g] (global -> local id or -1).
    w13_layout: the row order of the w13 given. GATE_THEN_UP (the public layout above): a layer that runs
    CUTE packs a second copy once. CHUNKED: w13 is already packed (moe2cta.pack_gate_up_rows(w13_public)), and
    the layer holds that one tensor: every GPU kernel reads it as is (the Triton GEMM1 on it is also the
    faster one at prefill), the TORCH twin unpacks a temporary per call. I must then be a multiple of
    GATE_UP_CHUNK (8). b13 stays in the public order either way.
    routing may be None when the layer is only ever called with precomputed (topk_weights, topk_ids).
    token_gemv_max_tokens: which TRITON batches run the token GEMVs (no dispatch, no combine launch). None:
    where grouped_gemm.triton_token_gemv.token_gemv_applies (1-8 tokens, fewer for larger experts, none for
    experts over 128 MB; measured on an H200); an int n: every batch of 1..n tokens; 0: never. Where AUTO splits
    (sm_90), it also sets the largest TRITON batch: n tokens, or by default one below the token GEMVs' own limit.
    gemm1_input (Gemm1Input, CUTE batches): TOKEN_ROWS lets the sm_90 GEMM1 read the token rows itself where its
    regular or wide kernel runs (no gather launch), GATHERED_COPY always gathers the rows into expert order first,
    AUTO takes TOKEN_ROWS where it was measured faster.
    `plan` says which backend runs a batch (`backend_for(num_tokens)`); `backend` is the one of decode-sized
    batches and `prefill_backend` that of larger ones (the same unless AUTO split them); `backend_reason` says
    why (the AUTO fallbacks, each with its reason).
    """

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        routing: RoutingConfig | None,
        activation: Activation | str = Activation.SWIGLU,
        router_weight_on: RouterWeightOn | str = RouterWeightOn.OUTPUT,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        expert_map: torch.Tensor | None = None,
        align: int = 128,
        backend: Backend | str = Backend.AUTO,
        id_check: IdCheck | str = IdCheck.AUTO,
        tuning_cache: "tuning.TuningCache | str | os.PathLike | None" = None,
        token_gemv_max_tokens: int | None = None,
        w13_layout: W13Layout | str = W13Layout.GATE_THEN_UP,
        gemm1_input: Gemm1Input | str = Gemm1Input.AUTO,
    ):
        if routing is not None and not isinstance(routing, RoutingConfig):
            raise TypeError(f"routing: expected a RoutingConfig or None, got {type(routing).__name__}")
        self.config = MoEConfig(routing, activation, router_weight_on, align)
        self.w13_layout = parse_w13_layout(w13_layout)
        num_experts, intermediate, hidden, num_global = check_weights(w13, w2, b13, b2, expert_map)
        if self.w13_layout is W13Layout.CHUNKED and intermediate % GATE_UP_CHUNK:
            raise ValueError(f"w13: w13_layout=chunked needs I a multiple of {GATE_UP_CHUNK} (w13 [E, 2I, H] packed by "
                             f"pack_gate_up_rows), got I={intermediate}")
        if e_score_correction_bias is not None:
            if routing is None or routing.scoring is not Scoring.SIGMOID_GROUPED:
                raise ValueError("e_score_correction_bias: only used by routing with scoring=SIGMOID_GROUPED")
            require_tensor("e_score_correction_bias", e_score_correction_bias, ndim=1, dtypes=FLOAT_DTYPES)
            if tuple(e_score_correction_bias.shape) != (num_global,):
                raise ValueError(
                    f"e_score_correction_bias: expected shape ({num_global},) (one per global expert), "
                    f"got {tuple(e_score_correction_bias.shape)}"
                )
            if e_score_correction_bias.device != w13.device:
                raise ValueError(f"e_score_correction_bias: expected a tensor on {w13.device}, got {e_score_correction_bias.device}")
        if routing is not None:
            routing.check_num_experts(num_global)
        self.w13, self.w2, self.b13, self.b2 = w13, w2, b13, b2
        self.e_score_correction_bias = e_score_correction_bias
        self.expert_map = expert_map
        self.num_experts, self.intermediate, self.hidden_size, self.num_global_experts = (
            num_experts, intermediate, hidden, num_global
        )
        self._checked_weights = (num_experts, intermediate, hidden, num_global)  # (validate skips their checks)
        self.id_check = IdCheck.parse(id_check)
        self.gemm1_input = Gemm1Input.parse(gemm1_input)
        if token_gemv_max_tokens is not None and (
                isinstance(token_gemv_max_tokens, bool) or not isinstance(token_gemv_max_tokens, int)
                or token_gemv_max_tokens < 0):
            raise ValueError(f"token_gemv_max_tokens: expected an int >= 0 or None, got {token_gemv_max_tokens!r}")
        self.token_gemv_max_tokens = token_gemv_max_tokens
        self._expert_bytes = _expert_bytes(hidden, intermediate, w13.dtype, (b13, b2))
        self.plan, self.backend_reason = _select_backend(
            Backend.parse(backend),
            expert_bytes=self._expert_bytes,
            token_gemv_max_tokens=token_gemv_max_tokens,
            dtype=w13.dtype,
            device=w13.device,
            hidden=hidden,
            intermediate=intermediate,
            num_experts=num_experts,
            num_global_experts=num_global,
            config=self.config,
            w13_layout=self.w13_layout,
        )
        if tuning_cache is None or isinstance(tuning_cache, tuning.TuningCache):
            self.tuning_cache = tuning_cache
        elif isinstance(tuning_cache, (str, os.PathLike)):
            if not os.path.isfile(tuning_cache):  # a mistyped path would otherwise serve untuned without a word
                raise ValueError(f"tuning_cache: {os.fspath(tuning_cache)!r} is not a file (write one with "
                                 "`moe2cta tune run --cache FILE`, or pass a TuningCache to start an empty one)")
            self.tuning_cache = tuning.TuningCache(tuning_cache)
        else:
            raise TypeError(f"tuning_cache: expected a TuningCache, a path or None, got {type(tuning_cache).__name__}")
        self.prepared = _prepare_cute(self) if Backend.CUTE in self.plan.backends else {}
        self._cute_plans: dict[tuple[int, int], _CutePlan] = {}
        # The token GEMVs address the weights as contiguous [E, N, K] (the grouped GEMMs take any strides): with
        # other strides every batch runs the grouped path.
        gemv_layout_ok = all(t is None or t.is_contiguous() for t in (w13, w2, b13, b2, expert_map))
        self._token_gemv = (_optional_module("grouped_gemm.triton_token_gemv")[0]
                            if Backend.TRITON in self.plan.backends and gemv_layout_ok else None)

    def _cute_plan(self, num_tokens: int, top_k: int) -> _CutePlan:
        """The CUTE forward's host choices for a batch of num_tokens tokens, made once per (T, k): a layer without a
        tuning cache asks the planner's pure functions nothing more per forward. At most CUTE_PLANS_KEPT batch
        sizes are kept (then they are made afresh). A layer with a tuning cache asks it on every forward."""
        if self.tuning_cache is not None:
            return _make_cute_plan(self, num_tokens, top_k)
        plan = self._cute_plans.get((num_tokens, top_k))
        if plan is None:
            if len(self._cute_plans) >= CUTE_PLANS_KEPT:
                self._cute_plans.clear()
            plan = self._cute_plans[(num_tokens, top_k)] = _make_cute_plan(self, num_tokens, top_k)
        return plan

    def _runs_token_gemvs(self, num_tokens: int) -> bool:
        if self._token_gemv is None:
            return False
        if self.token_gemv_max_tokens is not None:
            return 1 <= num_tokens <= self.token_gemv_max_tokens
        return self._token_gemv.token_gemv_applies(num_tokens, self._expert_bytes)

    @property
    def backend(self) -> Backend:
        """The backend of decode-sized batches (of every batch unless AUTO split them: see `plan`)."""
        return self.plan.decode

    @property
    def prefill_backend(self) -> Backend:
        """The backend of batches above the plan's decode limits (AUTO on sm_90: plan.decode_max_tokens)."""
        return self.plan.prefill

    def backend_for(self, num_tokens: int, top_k: int | None = None) -> Backend:
        """The backend that runs a batch of num_tokens tokens (top_k: the routing's, unless given)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
        if top_k is None:
            if self.config.top_k is None:
                raise ValueError("top_k: this layer has no routing, pass the top_k of the batch")
            top_k = self.config.top_k
        return self.plan.for_batch(num_tokens, top_k, self.num_global_experts)

    def __repr__(self) -> str:
        backends = "/".join(b.value for b in self.plan.backends)
        return (
            f"MoELayer(E={self.num_experts}, H={self.hidden_size}, I={self.intermediate}, dtype={self.w13.dtype}, "
            f"w13_layout={self.w13_layout.value}, "
            f"backend={backends}, reason={self.backend_reason!r})"
        )

    def _resolved_id_check(self) -> IdCheck:
        if self.id_check is not IdCheck.AUTO:
            return self.id_check
        if self.backend is Backend.TORCH or self.w13.device.type == "cpu":
            return IdCheck.CHECK
        return IdCheck.SKIP

    def __call__(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H] + router_logits [T, E_g] (or precomputed topk_weights / topk_ids) -> out [T, H].

        Runs on the inputs' device and that device's current stream, whichever device is current."""
        self.validate(hidden, router_logits, topk_weights=topk_weights, topk_ids=topk_ids)
        if hidden.is_cuda and hidden.device.index != torch.cuda.current_device():
            # Triton launches on the current device; torch ops and the CuTe kernels follow the tensors' device.
            with torch.cuda.device(hidden.device):
                return self._forward(hidden, router_logits, topk_weights, topk_ids)
        return self._forward(hidden, router_logits, topk_weights, topk_ids)

    def _forward(self, hidden, router_logits, topk_weights, topk_ids) -> torch.Tensor:
        hidden = hidden.contiguous()
        num_tokens = hidden.shape[0]
        top_k = topk_ids.shape[1] if topk_ids is not None else self.config.top_k
        backend = self.plan.for_batch(num_tokens, top_k, self.num_global_experts)
        if backend is Backend.TRITON and self._runs_token_gemvs(num_tokens):
            if topk_ids is None:
                topk_weights, topk_ids = _router_api().route(
                    router_logits, self.config.routing, self.e_score_correction_bias, backend=_triton_router_backend())
            # the kernels read int32 / int64 ids and any float weights as given (no conversion launch)
            return _forward_triton_tokens(self, hidden, topk_weights.contiguous(), topk_ids.contiguous())
        disp = None
        if self.backend is Backend.TORCH:
            if topk_ids is None:
                topk_weights, topk_ids = route_reference(router_logits, self.config.routing, self.e_score_correction_bias)
        elif topk_ids is None:
            topk_weights, topk_ids, disp = _route_dispatch_gpu(self, router_logits)
        if backend is Backend.TORCH:
            topk_weights = topk_weights.to(torch.float32)
            topk_ids = _router_api().int32_ids(topk_ids)  # int64 ids past int32 stay off-rank instead of wrapping
        # else the kernels read int32 / int64 ids and any float weights as given (no conversion launch)
        topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
        if disp is None and self.backend is not Backend.TORCH:
            disp = _dispatch_gpu(self, topk_ids)
        return _FORWARD[backend](self, hidden, topk_weights, topk_ids, disp)

    forward = __call__

    def check_hidden(self, hidden: torch.Tensor) -> None:
        """hidden's dtype and device against the layer's weights, the error naming hidden (reads no values)."""
        if isinstance(hidden, torch.Tensor) and hidden.dtype in FLOAT_DTYPES:
            if hidden.dtype != self.w13.dtype:
                raise TypeError(f"hidden: expected dtype {self.w13.dtype} (the layer's weights), got {hidden.dtype}")
            if hidden.device != self.w13.device:
                raise ValueError(f"hidden: expected a tensor on {self.w13.device} (the layer's weights), got {hidden.device}")

    def validate(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
    ) -> MoEProblem:
        """All input checks of a call (no kernel runs); returns the problem's shapes."""
        self.check_hidden(hidden)
        return validate_moe(
            hidden,
            self.w13,
            self.w2,
            router_logits=router_logits,
            routing=self.config.routing,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            b13=self.b13,
            b2=self.b2,
            e_score_correction_bias=self.e_score_correction_bias if router_logits is not None else None,
            expert_map=self.expert_map,
            id_check=self._resolved_id_check(),
            checked_weights=self._checked_weights,
        )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor | None = None,
    *,
    routing: RoutingConfig | None = None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    activation: Activation | str = Activation.SWIGLU,
    router_weight_on: RouterWeightOn | str = RouterWeightOn.OUTPUT,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    align: int = 128,
    backend: Backend | str = Backend.AUTO,
    id_check: IdCheck | str = IdCheck.AUTO,
    w13_layout: W13Layout | str = W13Layout.GATE_THEN_UP,
) -> torch.Tensor:
    """One MoE forward: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(hidden[t]) -> [T, H] in hidden's dtype.

    Pass router_logits [T, E_g] with routing, or precomputed topk_weights / topk_ids [T, k]. Arguments as in
    MoELayer. fused_moe prepares the weights on every call (CUTE packs a public w13; pass it packed with
    w13_layout="chunked" to skip that): build a MoELayer once to serve.
    AUTO runs the backend its plan picks for this batch and prepares only that one's weights.
    """
    # Shape / dtype / device checks first, so a bad input is reported as such before any backend choice.
    validate_moe(
        hidden,
        w13,
        w2,
        router_logits=router_logits,
        routing=routing,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        b13=b13,
        b2=b2,
        e_score_correction_bias=e_score_correction_bias,
        expert_map=expert_map,
        id_check=IdCheck.SKIP,
    )
    if Backend.parse(backend) is Backend.AUTO:
        config = MoEConfig(routing, activation, router_weight_on, align)
        num_experts, intermediate, hidden_size, num_global = check_weights(w13, w2, b13, b2, expert_map)
        plan, _ = _select_backend(
            Backend.AUTO, expert_bytes=_expert_bytes(hidden_size, intermediate, w13.dtype, (b13, b2)),
            dtype=w13.dtype, device=w13.device, hidden=hidden_size, intermediate=intermediate,
            num_experts=num_experts, num_global_experts=num_global, config=config,
            w13_layout=parse_w13_layout(w13_layout),
        )
        top_k = topk_ids.shape[1] if topk_ids is not None else routing.top_k
        backend = plan.for_batch(hidden.shape[0], top_k, num_global)
    layer = MoELayer(
        w13,
        w2,
        routing=routing,
        activation=activation,
        router_weight_on=router_weight_on,
        b13=b13,
        b2=b2,
        e_score_correction_bias=e_score_correction_bias,
        expert_map=expert_map,
        align=align,
        backend=backend,
        id_check=id_check,
        w13_layout=w13_layout,
    )
    return layer(hidden, router_logits, topk_weights=topk_weights, topk_ids=topk_ids)
