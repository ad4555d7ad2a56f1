"""The backends the benchmark puts side by side, each behind the same small adapter.

A backend is a name, an availability check (returns the reason when it cannot run here), a support check
for one model, and `build(preset, weights) -> callable(hidden [T,H] bf16, router_logits [T,E] fp32) ->
[T,H]`. Building may prepack weights; the runner builds one backend at a time and frees it afterwards.

Peers (implemented here):
- torch-loop: the transformers-style layer: route, then a Python loop over experts with host-side
  indexing (torch.where), bf16 matmuls, index_add into the output. Syncs with the host: timed eagerly.
- grouped-mm: moe2cta routing, a stable sort of the slots by expert, torch._grouped_mm with offsets for
  both GEMMs (bf16; sm_90/sm_100 on CUDA), the activation as bf16 torch ops, the weighted combine as one
  batched product per token. No host sync: graph-captured.
- flashinfer: flashinfer.fused_moe.cutlass_fused_moe (TensorRT-LLM CUTLASS MoE) with moe2cta routing,
  when the package imports; its fc1 takes [up; gate], so w13 is re-ordered once at build.
Ours (moe2cta.MoELayer): moe2cta-torch (Backend.TORCH), triton (Backend.TRITON), cute (Backend.CUTE:
sm_90 / sm_100), auto (Backend.AUTO); cute-gathered / cute-token-rows (Backend.CUTE with Gemm1Input.GATHERED_COPY /
TOKEN_ROWS: GEMM1 on a gathered copy / on the token rows wherever it can, the two sides of the AUTO choice);
cute-tuned (Backend.CUTE with the tuning cache `moe2cta tune run` wrote: $MOE2CTA_TUNING_CACHE, else
~/.cache/moe2cta/tuning.json, resolved when the backend is checked and built, never at import).
Ceilings (not MoE layers; the runner skips their correctness check, since their outputs are not the layer's), timed
in the same run and under the same clock as the layers, on fixed N(0, 1) activations:
- dense-ceiling: the two dense cuBLAS matmuls of the grouped GEMMs' total shape, [T*k, H] x [H, 2I] and [T*k, I] x
  [I, H], on one expert's weights: what a grouped GEMM cannot beat (the peer figures' "dense speed of light"). Only
  where the cell's floor is compute-bound: elsewhere the floor is the weights' bytes, which one expert's weights (held
  in L2) do not stream.
- expert-bmm-ceiling: cuBLAS batched over every expert at ceil(T*k / E) rows each, [E, m, H] x [E, H, 2I] and
  [E, m, I] x [E, I, H] on the layer's weights: the GEMMs of a perfectly balanced routing, with no padding, no
  routing, gather or combine, streaming every expert's weights as the layer does. Only where the cell hits every
  expert (else it would stream weights the layer does not).
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable

import torch

from moe2cta.grouped_gemm import Activation, apply_activation
from moe2cta.grouped_gemm.epilogue import gated_activation
from moe2cta.presets import ModelPreset
from moe2cta.router import Scoring

from .distributions import make_correction_bias
from .routing_twin import route_twin
from .timing import GraphCapture

__all__ = [
    "preset_layer",
    "BackendFamily",
    "CellFacts",
    "ExpertWeights",
    "make_expert_weights",
    "BackendSpec",
    "BACKENDS",
    "get_backend",
    "DEFAULT_GPU_BACKENDS",
    "DEFAULT_CPU_BACKENDS",
    "route_for_peers",
]


class BackendFamily(enum.Enum):
    PEER = "peer"
    OURS = "moe2cta"  # the targets apply
    REFERENCE = "moe2cta reference"  # moe2cta's torch twins: correct, not meant to be fast
    # not a MoE layer: a bound to compare the layers with (compute-bound cells only, no correctness check)
    CEILING = "ceiling"


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Expert weights in the public layout (docs/design.md): w13 [E, 2I, H], w2 [E, H, I]."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    e_score_correction_bias: torch.Tensor | None  # fp32 [E], DeepSeek-V3 style routers only


def make_expert_weights(preset: ModelPreset, device, *, seed: int, dtype: torch.dtype = torch.bfloat16) -> ExpertWeights:
    """Random weights scaled like real layers (std 1/sqrt(fan_in)), generated in place: one copy only."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = preset.num_experts, preset.hidden, preset.intermediate
    w13 = torch.empty(e, 2 * i, h, dtype=dtype, device=device)
    w2 = torch.empty(e, h, i, dtype=dtype, device=device)
    for expert in range(e):  # per expert: the generator's fp32 scratch stays small
        w13[expert].normal_(0.0, 1.0 / math.sqrt(h), generator=gen)
        w2[expert].normal_(0.0, 1.0 / math.sqrt(i), generator=gen)
    b13 = b2 = None
    if preset.has_bias:
        b13 = torch.empty(e, 2 * i, dtype=dtype, device=device).normal_(0.0, 0.1, generator=gen)
        b2 = torch.empty(e, h, dtype=dtype, device=device).normal_(0.0, 0.1, generator=gen)
    bias = None
    if preset.routing.scoring is Scoring.SIGMOID_GROUPED:
        bias = make_correction_bias(e, seed=seed + 1, device=device)
    return ExpertWeights(w13, w2, b13, b2, bias)


def preset_layer(preset: ModelPreset, weights: ExpertWeights, backend):
    """The measurement tools' layer: a moe2cta.MoELayer with the preset's routing and activation on `weights`."""
    from moe2cta import MoELayer

    return MoELayer(weights.w13, weights.w2, routing=preset.routing, activation=preset.activation, b13=weights.b13,
                    b2=weights.b2, e_score_correction_bias=weights.e_score_correction_bias, backend=backend)


def route_for_peers(logits, preset: ModelPreset, weights: ExpertWeights):
    """(topk_weights fp32, topk_ids int32): moe2cta.route when it exists, else the benchmark's twin."""
    try:
        from moe2cta import route
    except ImportError:
        routed = route_twin(logits, preset.routing, weights.e_score_correction_bias)
        return routed.topk_weights, routed.topk_ids
    return route(logits, preset.routing, e_score_correction_bias=weights.e_score_correction_bias)


def _ok(*_args) -> tuple[bool, str]:
    return True, ""


@dataclasses.dataclass(frozen=True)
class CellFacts:
    """What a backend's `applies` may ask of one benchmark cell before it is timed there."""

    tokens: int
    experts_hit: float  # mean over the cell's rotated inputs
    floor_bound: str  # "memory" or "compute" (floors.Floor.bound)


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    name: str
    family: BackendFamily
    description: str
    graph_capture: GraphCapture
    availability: Callable[[torch.device], tuple[bool, str]]
    build: Callable[[ModelPreset, ExpertWeights], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    supports: Callable[[ModelPreset, ExpertWeights], tuple[bool, str]] = _ok
    applies: Callable[[ModelPreset, CellFacts], tuple[bool, str]] = _ok  # per cell (unsupported there if not)


# --- torch loop (transformers style) ------------------------------------------------------------------


def _build_torch_loop(preset: ModelPreset, weights: ExpertWeights):
    w13, w2, b13, b2 = weights.w13, weights.w2, weights.b13, weights.b2
    inter = preset.intermediate
    activation = preset.activation

    def forward(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        routed = route_twin(logits, preset.routing, weights.e_score_correction_bias)
        topk_weights = routed.topk_weights.to(hidden.dtype)
        out = torch.zeros_like(hidden)
        mask = torch.nn.functional.one_hot(routed.topk_ids.long(), preset.num_experts).permute(2, 1, 0)  # [E,k,T]
        for expert in torch.nonzero(mask.sum(dim=(1, 2))).squeeze(1).tolist():
            slot, token = torch.where(mask[expert])
            x = hidden[token]
            h = x @ w13[expert].t()
            if b13 is not None:
                h = h + b13[expert]
            a = apply_activation(h[:, :inter], h[:, inter:], activation).to(hidden.dtype)
            y = a @ w2[expert].t()
            if b2 is not None:
                y = y + b2[expert]
            out.index_add_(0, token, y * topk_weights[token, slot, None])
        return out

    return forward


# --- torch._grouped_mm -----------------------------------------------------------------------------


def _grouped_mm_available(device: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major not in (9, 10):
            return False, f"torch._grouped_mm needs sm_90 or sm_100, this card is sm_{major}{minor}"
    try:
        a = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
        b = torch.randn(2, 64, 32, dtype=torch.bfloat16, device=device).transpose(-2, -1).contiguous().transpose(-2, -1)
        torch._grouped_mm(a, b, offs=torch.tensor([16, 32], dtype=torch.int32, device=device))
    except Exception as exc:
        return False, f"torch._grouped_mm probe failed: {type(exc).__name__}: {str(exc)[:160]}"
    return True, ""


def _grouped_mm_supports(preset: ModelPreset, weights: ExpertWeights) -> tuple[bool, str]:
    if weights.w13.is_cuda and weights.w13.dtype != torch.bfloat16:
        return False, f"torch._grouped_mm on CUDA is bf16 only, weights are {weights.w13.dtype}"
    if preset.hidden % 8 or preset.intermediate % 8:
        return False, "torch._grouped_mm needs H and I multiples of 8 (16-byte rows)"
    return True, ""


def _build_grouped_mm(preset: ModelPreset, weights: ExpertWeights):
    """The layer as a torch user writes it around torch._grouped_mm: a stable sort of the slots by expert, one
    gather, the two grouped GEMMs with the activation (and biases) as torch ops in the weights' dtype between them,
    the rows put back in slot order, and the combine as one batched [1, k] x [k, H] product per token (cuBLAS, fp32
    accumulation, router weights rounded to the weights' dtype). Until stop 45 this peer ran the activation and the
    combine in fp32 (an fp32 copy of every expert row, index_add_ into an fp32 output): 1.2-1.6x this time at prefill."""
    w13_t = weights.w13.transpose(-2, -1)  # [E, H, 2I], column-major per expert: a view, no copy
    w2_t = weights.w2.transpose(-2, -1)  # [E, I, H]
    b13, b2 = weights.b13, weights.b2
    inter, k, num_experts = preset.intermediate, preset.top_k, preset.num_experts
    activation = preset.activation

    def forward(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route_for_peers(logits, preset, weights)
        num_tokens = hidden.shape[0]
        flat_ids = topk_ids.reshape(-1).long()
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
        counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        a1 = hidden.index_select(0, order // k)
        h = torch._grouped_mm(a1, w13_t, offs=offs)
        if b13 is not None:
            h += b13.index_select(0, sorted_ids)
        a2 = gated_activation(h[:, :inter], h[:, inter:], activation)  # torch ops in bf16
        y = torch._grouped_mm(a2, w2_t, offs=offs)
        if b2 is not None:
            y += b2.index_select(0, sorted_ids)
        y_slots = torch.empty_like(y).index_copy_(0, order, y)  # row t * k + j: token t's slot j
        out = torch.bmm(topk_weights.to(y.dtype).unsqueeze(1), y_slots.view(num_tokens, k, -1))
        return out.view(num_tokens, -1)

    return forward


# --- dense ceiling ---------------------------------------------------------------------------------


MAX_CEILING_SETS = 8  # a case's rotated inputs at most (TimingConfig.max_rotation)


def _ceiling_operands(held: dict, rows: int, like: torch.Tensor, inputs: dict, outputs: dict) -> dict:
    """A ceiling's operands for `rows` and the rotated input `like` (the layer's hidden states): made on the first call
    with that input (the timing's warm-up calls come before its graph capture) and kept in `held` for the calls with
    it, one set per rotated input, so that a ceiling's operands rotate as the layers' inputs do (one set alone would
    stay in L2 where the layers' rotated inputs do not). inputs {name: shape}: N(0, 1) in that order from a generator
    seeded with `rows` (and the set's number), never zeros, since on a power-capped card the data moves the clock;
    outputs {name: shape}: empty."""
    if held.get("rows") != rows:
        held.clear()
        held["rows"] = rows
        held["sets"] = {}
    sets = held["sets"]
    key = like.data_ptr()
    if key not in sets and like.is_cuda and torch.cuda.is_current_stream_capturing():  # (capture fails: timed eagerly)
        raise RuntimeError("ceiling operands for an input not seen before the graph capture (more rotated inputs "
                           f"than MAX_CEILING_SETS = {MAX_CEILING_SETS}?)")
    if key not in sets and len(sets) >= MAX_CEILING_SETS:  # (cells of equal rows: another case's inputs, not kept)
        sets.clear()
    if key not in sets:
        gen = torch.Generator(device=like.device).manual_seed(rows + 1_000_003 * len(sets))
        ops = {name: torch.randn(*shape, generator=gen, device=like.device, dtype=like.dtype)
               for name, shape in inputs.items()}
        ops.update({name: torch.empty(*shape, device=like.device, dtype=like.dtype) for name, shape in outputs.items()})
        sets[key] = ops
    return sets[key]


def _build_dense_ceiling(preset: ModelPreset, weights: ExpertWeights):
    """The dense matmuls of the layer's total GEMM shape (module docstring)."""
    w13_t = weights.w13[0].transpose(0, 1)  # [H, 2I] of expert 0, K-major as the grouped GEMMs read it
    w2_t = weights.w2[0].transpose(0, 1)  # [I, H]
    k, hidden_size, inter = preset.top_k, preset.hidden, preset.intermediate
    held: dict = {}

    def forward(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0] * k
        ops = _ceiling_operands(held, rows, hidden, {"a1": (rows, hidden_size), "a2": (rows, inter)},
                                {"h": (rows, 2 * inter), "y": (rows, hidden_size)})
        torch.mm(ops["a1"], w13_t, out=ops["h"])
        torch.mm(ops["a2"], w2_t, out=ops["y"])
        return ops["y"]

    return forward


def _dense_ceiling_applies(preset: ModelPreset, cell: CellFacts) -> tuple[bool, str]:
    if cell.floor_bound != "compute":
        return False, "a compute ceiling; this cell's floor is memory-bound"
    return True, ""


def _build_expert_bmm_ceiling(preset: ModelPreset, weights: ExpertWeights):
    """The GEMMs of a perfectly balanced routing, batched over the experts (module docstring)."""
    w13_t = weights.w13.transpose(1, 2)  # [E, H, 2I]: views, no copy
    w2_t = weights.w2.transpose(1, 2)  # [E, I, H]
    k, experts, hidden_size, inter = preset.top_k, preset.num_experts, preset.hidden, preset.intermediate
    held: dict = {}

    def forward(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        rows = -(-hidden.shape[0] * k // experts)
        ops = _ceiling_operands(held, rows, hidden, {"a1": (experts, rows, hidden_size), "a2": (experts, rows, inter)},
                                {"h": (experts, rows, 2 * inter), "y": (experts, rows, hidden_size)})
        torch.bmm(ops["a1"], w13_t, out=ops["h"])
        torch.bmm(ops["a2"], w2_t, out=ops["y"])
        return ops["y"]

    return forward


def _expert_bmm_ceiling_applies(preset: ModelPreset, cell: CellFacts) -> tuple[bool, str]:
    if cell.experts_hit < preset.num_experts:
        return False, "streams every expert's weights; this cell does not hit every expert"
    return True, ""


# --- flashinfer ------------------------------------------------------------------------------------


def _flashinfer_available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "flashinfer needs a CUDA GPU"
    try:
        from flashinfer.fused_moe import cutlass_fused_moe  # noqa: F401
    except Exception as exc:
        return False, f"flashinfer not importable ({type(exc).__name__}: {str(exc)[:120]})"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, "flashinfer cutlass_fused_moe bf16 path is benchmarked on sm_90+ only"
    return True, ""


def _flashinfer_supports(preset: ModelPreset, weights: ExpertWeights) -> tuple[bool, str]:
    if weights.w13.dtype not in (torch.bfloat16, torch.float16):
        return False, f"flashinfer cutlass_fused_moe: bf16 / fp16 only here, weights are {weights.w13.dtype}"
    if preset.activation is Activation.GELU_GATED:
        return False, "flashinfer cutlass_fused_moe: gated GELU is not wired in this benchmark"
    return True, ""


def _build_flashinfer(preset: ModelPreset, weights: ExpertWeights):
    from flashinfer.fused_moe import cutlass_fused_moe

    inter, e = preset.intermediate, preset.num_experts
    device = weights.w13.device
    fc1 = torch.cat([weights.w13[:, inter:], weights.w13[:, :inter]], dim=1)  # [up; gate]
    fc1_bias = None
    if weights.b13 is not None:
        fc1_bias = torch.cat([weights.b13[:, inter:], weights.b13[:, :inter]], dim=1)
    extra = {}
    if preset.activation is Activation.SWIGLU_OAI:
        from moe2cta.grouped_gemm.epilogue import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

        extra = dict(
            swiglu_alpha=torch.full((e,), SWIGLU_OAI_ALPHA, dtype=torch.float32, device=device),
            swiglu_beta=torch.ones(e, dtype=torch.float32, device=device),
            swiglu_limit=torch.full((e,), SWIGLU_OAI_LIMIT, dtype=torch.float32, device=device),
        )

    def forward(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route_for_peers(logits, preset, weights)
        out = cutlass_fused_moe(
            hidden,
            topk_ids.to(torch.int32),
            topk_weights.float(),
            fc1,
            weights.w2,
            hidden.dtype,
            quant_scales=[],
            fc1_expert_biases=fc1_bias,
            fc2_expert_biases=weights.b2,
            **extra,
        )
        return out[0] if isinstance(out, (list, tuple)) else out

    return forward


# --- ours: moe2cta.MoELayer -----------------------------------------------------------------------


def _moe2cta_available(backend_name: str, needs_cuda: bool) -> Callable[[torch.device], tuple[bool, str]]:
    def available(device: torch.device) -> tuple[bool, str]:
        try:
            import moe2cta

            getattr(moe2cta, "MoELayer")
            getattr(moe2cta.Backend, backend_name)
        except Exception as exc:
            return False, f"moe2cta.MoELayer / Backend.{backend_name} not available yet ({type(exc).__name__}: {str(exc)[:100]})"
        if needs_cuda and device.type != "cuda":
            if backend_name == "TRITON":
                return False, "triton needs a CUDA GPU (the CPU interpreter mis-computes bf16 tl.dot)"
            return False, f"Backend.{backend_name} needs a CUDA GPU"
        if backend_name == "CUTE":
            major, minor = torch.cuda.get_device_capability(device)
            if major not in (9, 10):
                return False, f"cute kernels are sm_90 / sm_100; this card is sm_{major}{minor}"
        return True, ""

    return available


def _moe2cta_supports(backend_name: str) -> Callable[[ModelPreset, ExpertWeights], tuple[bool, str]]:
    def supports(preset: ModelPreset, weights: ExpertWeights) -> tuple[bool, str]:
        import moe2cta

        is_supported = getattr(moe2cta, "is_supported", None)
        if is_supported is None:
            return True, ""
        hidden = torch.empty(1, preset.hidden, dtype=weights.w13.dtype, device=weights.w13.device)
        ok, reason = is_supported(
            getattr(moe2cta.Backend, backend_name),
            hidden,
            weights.w13,
            weights.w2,
            routing=preset.routing,
            activation=preset.activation,
            b13=weights.b13,
            b2=weights.b2,
        )
        return bool(ok), str(reason)

    return supports


def _moe2cta_build(backend_name: str, **layer_options):
    def build(preset: ModelPreset, weights: ExpertWeights):
        import moe2cta

        return moe2cta.MoELayer(
            weights.w13,
            weights.w2,
            routing=preset.routing,
            activation=preset.activation,
            b13=weights.b13,
            b2=weights.b2,
            backend=getattr(moe2cta.Backend, backend_name),
            e_score_correction_bias=weights.e_score_correction_bias,
            **layer_options,
        )

    return build


def _tuning_cache_available(device: torch.device) -> tuple[bool, str]:
    ok, reason = _moe2cta_available("CUTE", True)(device)
    if not ok:
        return ok, reason
    from moe2cta import tuning

    path = tuning.default_cache_path()
    if not path.is_file():
        return False, f"no tuning cache at {path} (moe2cta tune run writes one; MOE2CTA_TUNING_CACHE names it)"
    if len(tuning.TuningCache(path)) == 0:
        return False, f"the tuning cache {path} holds no entries"
    return True, ""


def _moe2cta_build_tuned(preset: ModelPreset, weights: ExpertWeights):
    from moe2cta import tuning

    return _moe2cta_build("CUTE", tuning_cache=tuning.TuningCache(tuning.default_cache_path()))(preset, weights)


def _ours(name: str, backend_name: str, description: str, needs_cuda: bool,
          capture: GraphCapture = GraphCapture.TRY, family: BackendFamily = BackendFamily.OURS,
          **layer_options) -> BackendSpec:
    return BackendSpec(
        name,
        family,
        description,
        capture,
        _moe2cta_available(backend_name, needs_cuda),
        _moe2cta_build(backend_name, **layer_options),
        _moe2cta_supports(backend_name),
    )


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            "torch-loop",
            BackendFamily.PEER,
            "transformers-style per-expert loop (host-side indexing, eager)",
            GraphCapture.NEVER,
            _ok,
            _build_torch_loop,
        ),
        BackendSpec(
            "grouped-mm",
            BackendFamily.PEER,
            "moe2cta routing + sort + torch._grouped_mm (bf16; torch ops between the GEMMs, bmm combine)",
            GraphCapture.TRY,
            _grouped_mm_available,
            _build_grouped_mm,
            _grouped_mm_supports,
        ),
        BackendSpec(
            "dense-ceiling",
            BackendFamily.CEILING,
            "dense cuBLAS matmuls of the grouped GEMMs' total shape ([T*k, H] x [H, 2I], [T*k, I] x [I, H]), "
            "compute-bound cells only; not a MoE layer",
            GraphCapture.TRY,
            _ok,
            _build_dense_ceiling,
            applies=_dense_ceiling_applies,
        ),
        BackendSpec(
            "expert-bmm-ceiling",
            BackendFamily.CEILING,
            "cuBLAS bmm over every expert at T*k/E rows each (a balanced routing, no padding, no routing / gather / "
            "combine), cells that hit every expert; not a MoE layer",
            GraphCapture.TRY,
            _ok,
            _build_expert_bmm_ceiling,
            applies=_expert_bmm_ceiling_applies,
        ),
        _ours("moe2cta-torch", "TORCH", "moe2cta.MoELayer, Backend.TORCH (torch twins; reads ids on the host)",
              needs_cuda=False, capture=GraphCapture.NEVER, family=BackendFamily.REFERENCE),
        _ours("triton", "TRITON", "moe2cta.MoELayer, Backend.TRITON", needs_cuda=True),
        _ours("cute", "CUTE", "moe2cta.MoELayer, Backend.CUTE (sm_90 / sm_100 2-CTA grouped GEMMs)", needs_cuda=True),
        _ours("auto", "AUTO", "moe2cta.MoELayer, Backend.AUTO", needs_cuda=False),
        # the CUTE layer as it ran before GEMM1 read token rows itself (a gather launch first): A/B control
        _ours("cute-gathered", "CUTE", "moe2cta.MoELayer, Backend.CUTE, Gemm1Input.GATHERED_COPY", needs_cuda=True,
              gemm1_input="gathered_copy"),
        _ours("cute-token-rows", "CUTE", "moe2cta.MoELayer, Backend.CUTE, Gemm1Input.TOKEN_ROWS", needs_cuda=True,
              gemm1_input="token_rows"),
        BackendSpec(
            "cute-tuned",
            BackendFamily.OURS,
            "moe2cta.MoELayer, Backend.CUTE with the tuning cache (MOE2CTA_TUNING_CACHE, else the default path)",
            GraphCapture.TRY,
            _tuning_cache_available,
            _moe2cta_build_tuned,
            _moe2cta_supports("CUTE"),
        ),
        BackendSpec(
            "flashinfer",
            BackendFamily.PEER,
            "flashinfer cutlass_fused_moe (TensorRT-LLM CUTLASS MoE), moe2cta routing",
            GraphCapture.TRY,
            _flashinfer_available,
            _build_flashinfer,
            _flashinfer_supports,
        ),
    )
}

DEFAULT_GPU_BACKENDS = ("torch-loop", "grouped-mm", "triton", "cute", "flashinfer", "dense-ceiling",
                        "expert-bmm-ceiling")
DEFAULT_CPU_BACKENDS = ("torch-loop", "grouped-mm", "moe2cta-torch")


def get_backend(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]
