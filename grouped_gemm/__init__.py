"""moe2cta.grouped_gemm: grouped GEMM kernel families over experts (torch twin, Triton, CuTe sm90/sm100)."""
from .epilogue import Activation, GemmStage, apply_activation, epilogue_name
from .reference import grouped_gemm1_reference, grouped_gemm2_reference

__all__ = [
    "Activation",
    "GemmStage",
    "apply_activation",
    "epilogue_name",
    "grouped_gemm1_reference",
    "grouped_gemm2_reference",
]
