"""Static configuration of one MoE layer, and the enums of the public API.

Everything here is a value: frozen dataclasses and enums, no tensors. Strings are accepted wherever an enum
is expected (`Backend.parse("triton")`, `MoEConfig(routing, activation="swiglu_oai")`) and turned into the
enum once, at construction. The enums the kernels need (Scoring, Activation) are defined beside those kernels
and re-exported here.
"""
from __future__ import annotations

import dataclasses
import enum

from .grouped_gemm import Activation
from .grouped_gemm.epilogue import W13Layout
from .reference import RouterWeightOn
from .router import RoutingConfig, Scoring
from .router.config import parse_enum
from .router.reference import DEFAULT_TILE_HEIGHTS

__all__ = [
    "Activation",
    "Backend",
    "IdCheck",
    "MoEConfig",
    "RouterWeightOn",
    "RoutingConfig",
    "Scoring",
    "W13Layout",
    "DEFAULT_TILE_HEIGHTS",
    "parse_w13_layout",
]


_parse_enum = parse_enum  # one implementation for the project (router/config.py)


class Backend(enum.Enum):
    """Which implementation runs the layer.

    AUTO: on sm_90 with both GPU backends supported, TRITON for the few-token batches its token GEMVs win and
    CUTE for larger ones (moe2cta.api.BackendPlan, auto_triton_max_tokens); elsewhere TRITON on CUDA, else CUTE, else TORCH. The reason for each
    step down is recorded (MoELayer.backend_reason). TORCH: the torch twins of every stage (any
    device, the reference pipeline). TRITON: Triton router + Triton grouped GEMMs (CUDA; on CPU only under
    TRITON_INTERPRET=1, for tests). CUTE: Triton router + CuTe DSL grouped GEMMs (sm_90a / sm_100a).
    """

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CUTE = "cute"

    @classmethod
    def parse(cls, value: "Backend | str") -> "Backend":
        return _parse_enum(cls, value, "backend")


class IdCheck(enum.Enum):
    """Whether the values of topk_ids / expert_map are range-checked before the layer runs.

    Checking values reads them back to the host (a device sync), so it is off on the CUDA hot path.
    AUTO: CHECK for the TORCH backend and for CPU tensors, SKIP for TRITON / CUTE on CUDA.
    CHECK: always check (ValueError naming topk_ids or expert_map). SKIP: never check; out-of-range ids are
    then undefined behaviour of the kernels.
    """

    AUTO = "auto"
    CHECK = "check"
    SKIP = "skip"

    @classmethod
    def parse(cls, value: "IdCheck | str") -> "IdCheck":
        return _parse_enum(cls, value, "id_check")


class Gemm1Input(enum.Enum):
    """Where the CUTE backend's GEMM1 reads its rows from.

    GATHERED_COPY: a gather launch first writes the rows in padded expert order and GEMM1 reads that copy (every
    kernel family takes it). TOKEN_ROWS: on sm_90, where GEMM1 runs the regular (128-row tile) kernel or a wide
    (160 / 256 / 288 token-row) tile and the router weight is on the output, GEMM1 reads the token rows itself
    (cp.async, following the dispatch's sorted_slots: no gather launch); elsewhere (the decode tiles) GATHERED_COPY. AUTO: TOKEN_ROWS where it was measured faster
    (grouped_gemm.sm90_grouped_gemm.token_rows_pays: GEMM1s of intermediate size <= 1024 on the regular kernel or the
    160-row wide tile), else GATHERED_COPY. The choice changes no result bit: the same rows are multiplied either way.
    """

    AUTO = "auto"
    GATHERED_COPY = "gathered_copy"
    TOKEN_ROWS = "token_rows"

    @classmethod
    def parse(cls, value: "Gemm1Input | str") -> "Gemm1Input":
        return _parse_enum(cls, value, "gemm1_input")


def parse_w13_layout(value: "W13Layout | str") -> W13Layout:
    """The row order of a w13 handed to the layer: GATE_THEN_UP (public) or CHUNKED (pack_gate_up_rows)."""
    return _parse_enum(W13Layout, value, "w13_layout")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static facts of one MoE layer (no shapes: those come from the tensors).

    routing: how logits become (topk_weights, topk_ids); None for a layer that is only given precomputed
    (topk_weights, topk_ids). activation: GEMM1's gated epilogue.
    router_weight_on: OUTPUT (weight multiplies each expert's output; usual) or INPUT (Llama4: the weight
    scales the token before the expert). align: rows of each expert are padded to a multiple of `align` in
    the expert-order layout (docs/design.md); the GEMM backends need align to be a multiple of their tile
    height (see is_supported). tile_heights: M-tile heights for which dispatch builds tile prefix sums.
    """

    routing: RoutingConfig | None
    activation: Activation = Activation.SWIGLU
    router_weight_on: RouterWeightOn = RouterWeightOn.OUTPUT
    align: int = 128
    tile_heights: tuple = DEFAULT_TILE_HEIGHTS

    def __post_init__(self):
        if self.routing is not None and not isinstance(self.routing, RoutingConfig):
            raise TypeError(f"routing: expected a RoutingConfig or None, got {type(self.routing).__name__}")
        object.__setattr__(self, "activation", Activation.parse(self.activation))
        object.__setattr__(self, "router_weight_on", _parse_enum(RouterWeightOn, self.router_weight_on, "router_weight_on"))
        if not isinstance(self.align, int) or isinstance(self.align, bool) or self.align < 1:
            raise ValueError(f"align: expected an int >= 1, got {self.align!r}")
        if not isinstance(self.tile_heights, (tuple, list)):
            raise TypeError(f"tile_heights: expected a tuple of ints >= 1, got {self.tile_heights!r}")
        heights = tuple(self.tile_heights)
        if not heights or any(not isinstance(h, int) or isinstance(h, bool) or h < 1 for h in heights):
            raise ValueError(f"tile_heights: expected a non-empty tuple of ints >= 1, got {self.tile_heights!r}")
        object.__setattr__(self, "tile_heights", heights)

    @property
    def top_k(self) -> int | None:
        return None if self.routing is None else self.routing.top_k
