"""Public router functions: route, dispatch, gather, combine (and route_dispatch), with a backend choice.

RouterBackend.TORCH runs the twins of router/reference.py; RouterBackend.TRITON runs the kernels of
routing_triton.py, dispatch_triton.py and permute_triton.py (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1); AUTO picks TRITON for CUDA tensors and TORCH otherwise.

Every TRITON path is free of host synchronization and of data-dependent allocation: buffer sizes come from
T, k, E, align and the tile heights only, so the calls can be captured in a CUDA graph and replayed with new
routing. Kernel modules are imported lazily (importing moe2cta.router needs no GPU).
"""
from __future__ import annotations

import enum
import functools
import importlib

import torch

from .config import RoutingConfig, Scoring, next_pow2, parse_enum, triton_interpreting
from .reference import (
    DEFAULT_TILE_HEIGHTS,
    Dispatch,
    combine_reference,
    dispatch_reference,
    gather_reference,
    max_rows_for,
    route_reference,
)

__all__ = ["RouterBackend", "DispatchScheme", "GatherPadding", "route", "dispatch", "route_dispatch", "gather",
           "scatter_row_weights", "combine"]

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# router weights the kernels read in their own dtype and widen to fp32 on load (no conversion launch)
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Fused route + dispatch runs in one program: worth it while one SM routes the tokens quickly. H200, graph
# replay: T=1 fused 3.0 us vs 2.1 + 1.7 us apart (E=8, k=8); at T=32 fused and apart were equal.
FUSED_MAX_TOKENS = 16


class RouterBackend(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"

    @classmethod
    def parse(cls, value: "RouterBackend | str") -> "RouterBackend":
        return parse_enum(cls, value, "backend")


class DispatchScheme(enum.Enum):
    """How the TRITON dispatch runs (dispatch_triton.py): AUTO picks SINGLE_PROGRAM for T*k <= 512."""

    AUTO = "auto"
    SINGLE_PROGRAM = "single_program"  # one launch, one program (decode sizes)
    MULTI_BLOCK = "multi_block"  # three launches over blocks of slots (prefill sizes)


class GatherPadding(enum.Enum):
    """What `gather` writes into the padding rows of the expert-ordered A (an expert's rows up to its next
    multiple of align; the grouped GEMMs multiply them and never read their outputs)."""

    LEAVE = "leave"  # TRITON: untouched (whatever the buffer held); TORCH: zeros
    # hidden[0] in every padding row below row_offsets[E] (rows past it: as with LEAVE): activation-like
    # values the sm90 CuTe GEMMs run faster on than on zeros or stale zeros (docs/perf-notes-sm90.md, v10)
    TOKEN_ROW = "token_row"

    @classmethod
    def parse(cls, value) -> "GatherPadding":
        return parse_enum(cls, value, "padding")


@functools.cache
def _kernel_module(name: str):
    """One of the Triton kernel modules (routing_triton, dispatch_triton, permute_triton), imported on first use:
    importing moe2cta.router imports no Triton; after the first call this is a dict lookup, not an import."""
    return importlib.import_module(f"{__package__}.{name}")


def _resolve(backend, tensor: torch.Tensor) -> RouterBackend:
    if backend is RouterBackend.TRITON and tensor.is_cuda:  # (the layer's case, on every launch)
        return backend
    backend = RouterBackend.parse(backend)
    if backend is RouterBackend.AUTO:
        return RouterBackend.TRITON if tensor.is_cuda else RouterBackend.TORCH
    if backend is RouterBackend.TRITON and not tensor.is_cuda and not triton_interpreting():
        raise ValueError("backend: TRITON needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    return backend


_SM_COUNTS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """The device's SM count (asked once per device: get_device_properties costs ~4 us per call); 132 off CUDA."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _check_tensor(name, t, ndim, dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


# ---------------------------------------------------------------------------------------------- route
def _check_route_args(logits, config, bias):
    if not isinstance(config, RoutingConfig):
        raise TypeError(f"config: expected a RoutingConfig, got {type(config).__name__}")
    _check_tensor("logits", logits, 2, _LOGIT_DTYPES)
    num_experts = logits.shape[1]
    config.check_num_experts(num_experts)
    if bias is not None:
        _check_tensor("e_score_correction_bias", bias, 1, _LOGIT_DTYPES)
        if bias.shape[0] != num_experts:
            raise ValueError(f"e_score_correction_bias: expected shape ({num_experts},), got {tuple(bias.shape)}")
        if bias.device != logits.device:
            raise ValueError(f"e_score_correction_bias: expected device {logits.device}, got {bias.device}")
        if config.scoring is not Scoring.SIGMOID_GROUPED:
            raise ValueError(f"e_score_correction_bias: only used by SIGMOID_GROUPED, got scoring={config.scoring}")


def _route_meta(config: RoutingConfig, num_experts: int, has_bias: bool, device: torch.device) -> dict:
    """The routing kernel's constexprs (a shared dict: callers spread it, never change it)."""
    return _route_meta_cached(config, num_experts, has_bias, device.type == "cuda")


@functools.lru_cache(maxsize=256)
def _route_meta_cached(config: RoutingConfig, num_experts: int, has_bias: bool, on_cuda: bool) -> dict:
    routing = _kernel_module("routing_triton")
    MAX_EXPERTS, MAX_TOP_K, SCORING_CODES = routing.MAX_EXPERTS, routing.MAX_TOP_K, routing.SCORING_CODES
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"logits: TRITON routing supports E <= {MAX_EXPERTS}, got E={num_experts}")
    if config.top_k > MAX_TOP_K:
        raise ValueError(f"config.top_k: TRITON routing supports k <= {MAX_TOP_K}, got {config.top_k}")
    groups = config.num_expert_group or 0
    return dict(
        NUM_EXPERTS=num_experts,
        TOP_K=config.top_k,
        SCORING=SCORING_CODES[config.scoring.value],
        RENORMALIZE=bool(config.renormalize),
        HAS_BIAS=has_bias,
        NUM_GROUPS=groups,
        TOPK_GROUP=config.topk_group or 0,
        BLOCK_K=max(2, next_pow2(config.top_k)),
        BLOCK_G=max(2, next_pow2(max(groups, 1))),
        USE_LIBDEVICE=on_cuda,
    )


def route(logits: torch.Tensor, config: RoutingConfig, e_score_correction_bias: torch.Tensor | None = None,
          backend: RouterBackend | str = RouterBackend.AUTO) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (bf16/fp16/fp32) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32)."""
    _check_route_args(logits, config, e_score_correction_bias)
    return _route_checked(logits, config, e_score_correction_bias, _resolve(backend, logits))


def _route_checked(logits, config, e_score_correction_bias, resolved: RouterBackend):
    if resolved is RouterBackend.TORCH:
        return route_reference(logits, config, e_score_correction_bias)
    slots = logits.shape[0] * config.top_k
    if e_score_correction_bias is not None:
        e_score_correction_bias = e_score_correction_bias.contiguous()  # the kernel reads it with stride 1
    return _kernel_module("routing_triton").launch_route(
        logits, config, e_score_correction_bias, launch_options=_dependent_launch(logits.device, slots))


GATHER_PAD_BLOCK = 32  # padded rows per padding program of the gather (GatherPadding.TOKEN_ROW)

# Launches of at most this many (token, expert) slots release the next kernel's launch at their start;
# larger ones when their blocks exit: a dependent grid made resident early waits on the SMs beside a long
# primary, which cost the full layer 5-10% at T >= 8192 (H200).
EARLY_TRIGGER_SLOTS = 4096


@functools.lru_cache(maxsize=16)
def _dependent_launch_options(index: int) -> tuple[dict, dict]:
    """(options of a launch of at most EARLY_TRIGGER_SLOTS slots, of a larger one) on CUDA device `index`,
    asked once per device, not per launch."""
    on = torch.cuda.get_device_capability(index)[0] >= 9
    return ({"DEPENDENT_LAUNCH": 2 if on else 0, "launch_pdl": on},
            {"DEPENDENT_LAUNCH": 1 if on else 0, "launch_pdl": on})


_NO_DEPENDENT_LAUNCH = {"DEPENDENT_LAUNCH": 0, "launch_pdl": False}


def _dependent_launch(device: torch.device, slots: int) -> dict:
    """Launch options: programmatic dependent launch on CUDA sm_90+ (each kernel waits for the previous
    kernel's results with griddepcontrol.wait before reading them), so the short kernels of a decode step
    start without a launch gap; inside a CUDA graph the edges are kept. DEPENDENT_LAUNCH: 0 off, 1 wait,
    2 wait and release the next launch at once (slots <= EARLY_TRIGGER_SLOTS). A shared dict: spread it,
    never change it."""
    if device.type != "cuda":
        return _NO_DEPENDENT_LAUNCH
    early, late = _dependent_launch_options(device.index if device.index is not None else torch.cuda.current_device())
    return early if slots <= EARLY_TRIGGER_SLOTS else late


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------- dispatch
def _check_dispatch_static(num_experts, align, tile_heights, expert_map, device):
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1, got {num_experts!r}")
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align: expected an int >= 1, got {align!r}")
    if not isinstance(tile_heights, (tuple, list)):
        raise TypeError(f"tile_heights: expected a tuple of ints >= 1, got {tile_heights!r}")
    heights = tuple(tile_heights)
    if any((not isinstance(h, int)) or isinstance(h, bool) or h < 1 for h in heights):
        raise ValueError(f"tile_heights: expected ints >= 1, got {tile_heights!r}")
    if expert_map is not None:
        _check_tensor("expert_map", expert_map, 1, (torch.int32, torch.int64))
        if expert_map.numel() == 0:
            raise ValueError("expert_map: expected at least one entry (global expert id -> local id or -1)")
        if expert_map.device != device:
            raise ValueError(f"expert_map: expected device {device}, got {expert_map.device}")
    return heights


def _check_dispatch_args(topk_ids, num_experts, align, tile_heights, expert_map):
    _check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    return _check_dispatch_static(num_experts, align, tile_heights, expert_map, topk_ids.device)


def _dispatch_buffers(num_tokens, top_k, num_experts, align, heights, device):
    i32 = dict(dtype=torch.int32, device=device)
    max_rows = max_rows_for(num_tokens, top_k, num_experts, align)
    return (
        torch.empty(num_experts, **i32),
        torch.empty(num_experts + 1, **i32),
        torch.empty(num_experts + 1, **i32),
        torch.empty(len(heights), num_experts + 1, **i32),
        torch.empty(max_rows, **i32),
        torch.empty(num_tokens * top_k, **i32),
    )


def _dispatch_static_meta(num_experts, align, heights, expert_map):
    """(base constexprs, offset constexprs) of the dispatch kernels (shared dicts: spread them, never change them)."""
    return _dispatch_static_meta_cached(num_experts, align, tuple(heights), expert_map is not None,
                                        expert_map.numel() if expert_map is not None else num_experts)


@functools.lru_cache(maxsize=256)
def _dispatch_static_meta_cached(num_experts, align, heights, has_map, num_global):
    MAX_TILE_HEIGHTS = _kernel_module("dispatch_triton").MAX_TILE_HEIGHTS
    MAX_EXPERTS = _kernel_module("routing_triton").MAX_EXPERTS
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: TRITON dispatch supports <= {MAX_EXPERTS}, got {num_experts}")
    if len(heights) > MAX_TILE_HEIGHTS:
        raise ValueError(f"tile_heights: TRITON dispatch supports <= {MAX_TILE_HEIGHTS} heights, got {heights}")
    padded = tuple(heights) + (1,) * (MAX_TILE_HEIGHTS - len(heights))
    return dict(
        NUM_EXPERTS=num_experts,
        NUM_GLOBAL_EXPERTS=num_global,
        HAS_MAP=has_map,
        NUM_BINS=max(32, next_pow2(num_experts + 1)),
    ), dict(ALIGN=align, NUM_HEIGHTS=len(heights), H0=padded[0], H1=padded[1], H2=padded[2], H3=padded[3])


MAX_DISPATCH_SLOTS = 2**31 // 1024  # T*k the TRITON dispatch takes (dispatch_triton.py: Limits)


def _launch_dispatch(ids_flat, num_slots, max_rows, expert_map, bufs, base_meta, offset_meta, scheme, block_slots):
    module = _kernel_module("dispatch_triton")
    AUTO_SINGLE_SLOTS, SINGLE_MAX_SLOTS = module.AUTO_SINGLE_SLOTS, module.SINGLE_MAX_SLOTS
    kernels = module.jit_functions()

    counts, token_offsets, row_offsets, tile_offsets, sorted_slots, slot_rows = bufs
    device = ids_flat.device
    emap = expert_map if expert_map is not None else ids_flat
    num_bins = base_meta["NUM_BINS"]
    if num_slots >= MAX_DISPATCH_SLOTS:  # (the kernels' int32 block x bin offsets; dispatch_triton.py's limits)
        raise ValueError(f"topk_ids: the TRITON dispatch takes T*k < {MAX_DISPATCH_SLOTS} slots, got {num_slots}")
    if scheme is DispatchScheme.AUTO:
        scheme = DispatchScheme.SINGLE_PROGRAM if num_slots <= AUTO_SINGLE_SLOTS else DispatchScheme.MULTI_BLOCK
    if scheme is DispatchScheme.SINGLE_PROGRAM:
        if num_slots > SINGLE_MAX_SLOTS:
            raise ValueError(f"scheme: SINGLE_PROGRAM takes T*k <= {SINGLE_MAX_SLOTS}, got {num_slots}")
        block_s = max(16, next_pow2(num_slots))
        scratch = torch.empty(num_bins, dtype=torch.int32, device=device)
        kernels.dispatch_single_kernel[(1,)](
            ids_flat, emap, counts, token_offsets, row_offsets, tile_offsets, sorted_slots, slot_rows, scratch,
            num_slots, max_rows, BLOCK_S=block_s, FILL_BLOCK=2048, num_warps=4,
            **base_meta, **offset_meta, **_dependent_launch(device, num_slots),
        )
        return
    block_s = module.multi_block_slots(num_slots) if block_slots is None else block_slots
    if block_s < 16 or block_s & (block_s - 1) or block_s > 4096:
        raise ValueError(f"block_slots: expected a power of two in [16, 4096], got {block_s}")
    num_blocks = max(1, _cdiv(num_slots, block_s))
    hist = torch.empty(num_blocks, num_bins, dtype=torch.int32, device=device)
    prefix = torch.empty(num_blocks, num_bins, dtype=torch.int32, device=device)
    fill_block = 1024
    stripe = _cdiv(_cdiv(max_rows, num_blocks), fill_block) * fill_block
    kernels.block_histogram_kernel[(num_blocks,)](
        ids_flat, emap, hist, sorted_slots, num_slots, max_rows, stripe, BLOCK_S=block_s, FILL_BLOCK=fill_block,
        num_warps=4, **base_meta, **_dependent_launch(device, num_slots),
    )
    scan_bins = min(32, num_bins)
    kernels.scan_kernel[(num_bins // scan_bins,)](
        hist, prefix, counts, num_blocks, NUM_EXPERTS=base_meta["NUM_EXPERTS"], NUM_BINS=num_bins,
        SCAN_BINS=scan_bins, BLOCK_B=64, num_warps=4, **_dependent_launch(device, num_slots),
    )
    kernels.place_kernel[(num_blocks,)](
        ids_flat, emap, prefix, counts, token_offsets, row_offsets, tile_offsets, sorted_slots, slot_rows,
        num_slots, BLOCK_S=block_s, num_warps=4, **base_meta, **offset_meta, **_dependent_launch(device, num_slots),
    )


def dispatch(topk_ids: torch.Tensor, num_experts: int, *, align: int = 128,
             tile_heights: tuple = DEFAULT_TILE_HEIGHTS, expert_map: torch.Tensor | None = None,
             backend: RouterBackend | str = RouterBackend.AUTO,
             scheme: DispatchScheme | str = DispatchScheme.AUTO, block_slots: int | None = None) -> Dispatch:
    """topk_ids [T, k] (global expert ids) -> Dispatch over num_experts local experts (docs/design.md).

    Ids outside [0, num_experts) (or mapped to -1 by expert_map [E_global]) are off-rank: slot_rows -1.
    scheme / block_slots: TRITON only (block_slots: slots per program of MULTI_BLOCK; default 256, 512
    past 32K slots).
    """
    heights = _check_dispatch_args(topk_ids, num_experts, align, tile_heights, expert_map)
    scheme = parse_enum(DispatchScheme, scheme, "scheme")
    return _dispatch_checked(topk_ids, num_experts, align, heights, expert_map, _resolve(backend, topk_ids), scheme,
                             block_slots)


def int32_ids(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids (or expert_map entries) as a contiguous int32 tensor, for callers that need int32. int64 values
    outside int32's range are clamped to -1 / 2**31 - 1, so they stay off-rank (outside [0, E)) instead of wrapping
    onto an expert. The kernels here do not need it: they read int32 and int64 ids as given."""
    if ids.dtype != torch.int32:
        ids = ids.clamp(-1, 2**31 - 1).to(torch.int32)
    return ids.contiguous()


def _dispatch_checked(topk_ids, num_experts, align, heights, expert_map, resolved: RouterBackend,
                      scheme: DispatchScheme = DispatchScheme.AUTO, block_slots=None) -> Dispatch:
    if resolved is RouterBackend.TORCH:
        return dispatch_reference(topk_ids, num_experts, align=align, tile_heights=heights, expert_map=expert_map)
    num_tokens, top_k = topk_ids.shape
    base_meta, offset_meta = _dispatch_static_meta(num_experts, align, heights, expert_map)
    ids_flat = topk_ids.reshape(-1).contiguous()  # int32 or int64: the kernels compare ids in their own type
    if expert_map is not None:
        expert_map = expert_map.contiguous()
    bufs = _dispatch_buffers(num_tokens, top_k, num_experts, align, heights, topk_ids.device)
    _launch_dispatch(ids_flat, num_tokens * top_k, bufs[4].numel(), expert_map, bufs, base_meta, offset_meta,
                     scheme, block_slots)
    return Dispatch(*bufs, align, heights)


@functools.lru_cache(maxsize=256)
def _fused_route_meta(config, num_experts, has_bias, on_cuda) -> dict:
    """_route_meta for the fused route + dispatch kernel, whose routing part names NUM_EXPERTS R_NUM_EXPERTS."""
    meta = _route_meta_cached(config, num_experts, has_bias, on_cuda)
    return {("R_" + k if k == "NUM_EXPERTS" else k): v for k, v in meta.items()}


def route_dispatch(logits: torch.Tensor, config: RoutingConfig, num_experts: int | None = None, *,
                   e_score_correction_bias: torch.Tensor | None = None, align: int = 128,
                   tile_heights: tuple = DEFAULT_TILE_HEIGHTS, expert_map: torch.Tensor | None = None,
                   backend: RouterBackend | str = RouterBackend.AUTO):
    """route() then dispatch() -> (topk_weights, topk_ids, Dispatch). num_experts: local experts (default:
    logits.shape[1]). With TRITON and T <= FUSED_MAX_TOKENS (static), one launch does both."""
    _check_route_args(logits, config, e_score_correction_bias)
    num_experts = logits.shape[1] if num_experts is None else num_experts
    heights = _check_dispatch_static(num_experts, align, tile_heights, expert_map, logits.device)
    if expert_map is None and num_experts != logits.shape[1]:
        raise ValueError(f"num_experts: expected logits.shape[1] ({logits.shape[1]}) without expert_map, got {num_experts}")
    if expert_map is not None and expert_map.shape[0] != logits.shape[1]:
        raise ValueError(f"expert_map: expected one entry per logit column ({logits.shape[1]}), got {expert_map.shape[0]}")
    resolved = _resolve(backend, logits)
    num_tokens = logits.shape[0]
    if resolved is RouterBackend.TORCH or num_tokens > FUSED_MAX_TOKENS:
        weights, ids = _route_checked(logits, config, e_score_correction_bias, resolved)
        disp = _dispatch_checked(ids, num_experts, align, heights, expert_map, resolved)
        return weights, ids, disp
    route_launch_params = _kernel_module("routing_triton").route_launch_params
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    route_meta = _fused_route_meta(config, logits.shape[1], e_score_correction_bias is not None, logits.is_cuda)
    base_meta, offset_meta = _dispatch_static_meta(num_experts, align, heights, expert_map)
    if expert_map is not None:
        expert_map = expert_map.contiguous()  # int32 or int64, read as given
    if e_score_correction_bias is not None:
        e_score_correction_bias = e_score_correction_bias.contiguous()  # the kernel reads it with stride 1
    top_k = config.top_k
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    bufs = _dispatch_buffers(num_tokens, top_k, num_experts, align, heights, logits.device)
    scratch = torch.empty(base_meta["NUM_BINS"], dtype=torch.int32, device=logits.device)
    block_t, block_e, _ = route_launch_params(num_tokens, logits.shape[1], num_sms=1)
    block_t = min(block_t, max(1, next_pow2(num_tokens)))
    bias = e_score_correction_bias if e_score_correction_bias is not None else weights
    emap = expert_map if expert_map is not None else ids
    num_slots = num_tokens * top_k
    _kernel_module("dispatch_triton").jit_functions().route_dispatch_fused_kernel[(1,)](
        logits, bias, weights, ids, num_tokens, logits.stride(0), float(config.routed_scaling_factor),
        emap, *bufs, scratch, num_slots, bufs[4].numel(),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_S=max(16, next_pow2(num_slots)), FILL_BLOCK=2048, num_warps=4,
        **route_meta, **base_meta, **offset_meta, **_dependent_launch(logits.device, num_slots),
    )
    return weights, ids, Dispatch(*bufs, align, heights)


# ------------------------------------------------------------------------------------ gather / combine
def _check_dispatch(disp):
    if not isinstance(disp, Dispatch):
        raise TypeError(f"disp: expected a Dispatch, got {type(disp).__name__}")


def _check_count(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")


def gather(hidden: torch.Tensor, disp: Dispatch, top_k: int, scale: torch.Tensor | None = None,
           out: torch.Tensor | None = None, backend: RouterBackend | str = RouterBackend.AUTO,
           slot_weights: torch.Tensor | None = None, row_weights_out: torch.Tensor | None = None,
           padding: GatherPadding | str = GatherPadding.LEAVE) -> torch.Tensor:
    """hidden [T, H] -> a1 [max_rows, H]: a1[slot_rows[s]] = hidden[s // k] (* scale[s]). Padding rows
    (GatherPadding): LEAVE: TRITON leaves them untouched (out=None: uninitialized), TORCH zeroes them;
    TOKEN_ROW: both write hidden[0] into every padding row below row_offsets[E] (TRITON: in the same launch;
    the rows past it as with LEAVE).

    slot_weights [T, k] (any float dtype, read as fp32) with row_weights_out [max_rows] fp32 (both or neither): also
    row_weights_out[slot_rows[s]] = slot_weights.flat[s], the router weight of each row in expert order (GEMM2's
    row scale), in the same launch; its padding rows are left as they are."""
    _check_tensor("hidden", hidden, 2, _ACT_DTYPES)
    _check_dispatch(disp)
    _check_count("top_k", top_k, 1)
    num_tokens, hidden_size = hidden.shape
    if disp.slot_rows.numel() != num_tokens * top_k:
        raise ValueError(f"disp: slot_rows has {disp.slot_rows.numel()} slots, expected T*k = {num_tokens * top_k}")
    if scale is not None:
        _check_tensor("scale", scale, 2, _WEIGHT_DTYPES)
        if tuple(scale.shape) != (num_tokens, top_k):
            raise ValueError(f"scale: expected shape ({num_tokens}, {top_k}), got {tuple(scale.shape)}")
    max_rows = disp.sorted_slots.numel()
    padding = GatherPadding.parse(padding)
    if (slot_weights is None) != (row_weights_out is None):
        raise ValueError("slot_weights, row_weights_out: pass both (the router weights and the [max_rows] output) or neither")
    if slot_weights is not None:
        _check_tensor("slot_weights", slot_weights, 2, _WEIGHT_DTYPES)
        if tuple(slot_weights.shape) != (num_tokens, top_k):
            raise ValueError(f"slot_weights: expected shape ({num_tokens}, {top_k}), got {tuple(slot_weights.shape)}")
        _check_tensor("row_weights_out", row_weights_out, 1, (torch.float32,))
        if row_weights_out.shape[0] != max_rows or not row_weights_out.is_contiguous():
            raise ValueError(f"row_weights_out: expected a contiguous [{max_rows}] tensor, got {tuple(row_weights_out.shape)}")
    if out is not None:
        _check_tensor("out", out, 2, (hidden.dtype,))
        if out.shape[0] < max_rows or out.shape[1] != hidden_size or out.stride(1) != 1:
            raise ValueError(f"out: expected >= {max_rows} contiguous rows of {hidden_size}, got {tuple(out.shape)}")
    if _resolve(backend, hidden) is RouterBackend.TORCH:
        a1 = gather_reference(hidden, disp, top_k, scale)
        if padding is GatherPadding.TOKEN_ROW and num_tokens > 0:
            used = torch.arange(max_rows, device=a1.device) < disp.row_offsets[-1].to(a1.device)
            a1[used & (disp.sorted_slots.to(a1.device) < 0)] = hidden[0]
        if slot_weights is not None:
            rows = disp.slot_rows.long()
            valid = rows >= 0
            row_weights_out[rows[valid]] = slot_weights.reshape(-1)[valid].to(torch.float32)
        if out is None:
            return a1
        out[:max_rows].copy_(a1)
        return out
    permute = _kernel_module("permute_triton")
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if out is None:
        out = torch.empty(max_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    num_slots = num_tokens * top_k
    if num_slots and hidden_size == 0 and slot_weights is not None:  # no row to copy; the row weights still
        scatter_row_weights(slot_weights, disp, row_weights_out, RouterBackend.TRITON, top_k=top_k)
    if num_slots == 0 or hidden_size == 0:
        return out
    block_h, num_warps = permute.permute_launch_params(hidden_size, hidden.element_size())
    block_s = permute.GATHER_SLOTS_PER_PROGRAM
    scale_arg = scale.contiguous() if scale is not None else disp.slot_rows
    weights_arg = slot_weights.contiguous() if slot_weights is not None else disp.slot_rows  # (unused when None)
    slot_programs = _cdiv(num_slots, block_s)
    pad_token_row = padding is GatherPadding.TOKEN_ROW
    pad_programs = _cdiv(max_rows, GATHER_PAD_BLOCK) if pad_token_row else 0
    grid = (slot_programs + pad_programs, _cdiv(hidden_size, block_h))
    permute.jit_functions().gather_kernel[grid](
        hidden, scale_arg, disp.slot_rows, out, weights_arg,
        row_weights_out if row_weights_out is not None else disp.slot_rows, num_slots, hidden_size,
        hidden.stride(0), out.stride(0), disp.sorted_slots, disp.row_offsets, disp.row_offsets.numel() - 1,
        slot_programs,
        TOP_K=top_k, HAS_SCALE=scale is not None, BLOCK_S=block_s, BLOCK_H=block_h,
        ROW_WEIGHTS=slot_weights is not None, PAD_TOKEN_ROW=pad_token_row, BLOCK_P=GATHER_PAD_BLOCK,
        num_warps=num_warps, **_dependent_launch(hidden.device, num_slots),
    )
    return out


def scatter_row_weights(slot_weights: torch.Tensor, disp: Dispatch, out: torch.Tensor,
                        backend: RouterBackend | str = RouterBackend.AUTO, *, top_k: int | None = None) -> torch.Tensor:
    """out[slot_rows[s]] = slot_weights.flat[s] for every slot on this rank: the router weight of each row in expert
    order (GEMM2's row scale) where no gather launch writes it (a GEMM1 that reads the token rows itself). Padding
    rows of `out` are left as they are. slot_weights [T, k] (any float dtype, read as fp32), out a contiguous fp32
    [max_rows]. A dispatch holds T*k, not T and k: pass top_k and a [k, T] tensor (transposed) is refused too."""
    _check_dispatch(disp)
    _check_tensor("slot_weights", slot_weights, 2, _WEIGHT_DTYPES)
    if slot_weights.numel() != disp.slot_rows.numel():
        raise ValueError(f"slot_weights: expected T*k = {disp.slot_rows.numel()} weights, got {tuple(slot_weights.shape)}")
    if top_k is not None:
        _check_count("top_k", top_k, 1)
        if slot_weights.shape[1] != top_k:
            raise ValueError(f"slot_weights: expected shape [T, {top_k}] (top_k columns), got {tuple(slot_weights.shape)}")
    _check_tensor("out", out, 1, (torch.float32,))
    max_rows = disp.sorted_slots.numel()
    if out.shape[0] != max_rows or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{max_rows}] tensor, got {tuple(out.shape)}")
    if _resolve(backend, slot_weights) is RouterBackend.TORCH:
        rows = disp.slot_rows.long()
        valid = rows >= 0
        out[rows[valid]] = slot_weights.reshape(-1)[valid].to(torch.float32)
        return out
    permute = _kernel_module("permute_triton")
    num_slots = disp.slot_rows.numel()
    if num_slots:
        permute.jit_functions().row_weights_kernel[(_cdiv(num_slots, permute.ROW_WEIGHTS_BLOCK),)](
            slot_weights.contiguous(), disp.slot_rows, out, num_slots, BLOCK=permute.ROW_WEIGHTS_BLOCK,
            **_dependent_launch(slot_weights.device, num_slots),
        )
    return out


def combine(y: torch.Tensor, disp: Dispatch, topk_weights: torch.Tensor | None, num_tokens: int, top_k: int,
            out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
            backend: RouterBackend | str = RouterBackend.AUTO) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[slot_rows[t*k + j]], j in order, fp32 accumulation; rows -1 add nothing."""
    _check_tensor("y", y, 2, _ACT_DTYPES)
    _check_dispatch(disp)
    _check_count("num_tokens", num_tokens, 0)
    _check_count("top_k", top_k, 1)
    if disp.slot_rows.numel() != num_tokens * top_k:
        raise ValueError(f"disp: slot_rows has {disp.slot_rows.numel()} slots, expected T*k = {num_tokens * top_k}")
    max_rows = disp.sorted_slots.numel()
    if y.shape[0] < max_rows:
        raise ValueError(
            f"y: expected at least {max_rows} rows (the dispatch's padded expert order, disp.sorted_slots), "
            f"got shape {tuple(y.shape)}"
        )
    if topk_weights is not None:
        _check_tensor("topk_weights", topk_weights, 2, _WEIGHT_DTYPES)
        if tuple(topk_weights.shape) != (num_tokens, top_k):
            raise ValueError(f"topk_weights: expected shape ({num_tokens}, {top_k}), got {tuple(topk_weights.shape)}")
    out_dtype = out_dtype or y.dtype
    if out_dtype not in _ACT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {_ACT_DTYPES}, got {out_dtype}")
    hidden_size = y.shape[1]
    if out is not None:
        _check_tensor("out", out, 2, (out_dtype,))
        if tuple(out.shape) != (num_tokens, hidden_size) or out.stride(1) != 1:
            raise ValueError(f"out: expected contiguous rows of shape ({num_tokens}, {hidden_size}), got {tuple(out.shape)}")
    if _resolve(backend, y) is RouterBackend.TORCH:
        res = combine_reference(y, disp, topk_weights, num_tokens, top_k, out_dtype)
        if out is None:
            return res
        out.copy_(res)
        return out
    permute = _kernel_module("permute_triton")
    if y.stride(1) != 1:
        y = y.contiguous()
    if out is None:
        out = torch.empty(num_tokens, hidden_size, dtype=out_dtype, device=y.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    block_h, num_warps = permute.permute_launch_params(hidden_size, y.element_size())
    block_t = permute.COMBINE_TOKENS_PER_PROGRAM
    w_arg = topk_weights.contiguous() if topk_weights is not None else disp.slot_rows
    grid = (_cdiv(num_tokens, block_t), _cdiv(hidden_size, block_h))
    permute.jit_functions().combine_kernel[grid](
        y, w_arg, disp.slot_rows, out, num_tokens, hidden_size, y.stride(0), out.stride(0),
        TOP_K=top_k, HAS_WEIGHTS=topk_weights is not None, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps,
        **_dependent_launch(y.device, num_tokens * top_k),
    )
    return out
