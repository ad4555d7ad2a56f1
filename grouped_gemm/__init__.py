"""moe2cta.grouped_gemm: grouped GEMM kernel families over experts (torch twin, Triton, CuTe sm90/sm100)."""
from .epilogue import Activation, apply_activation
from .reference import grouped_gemm1_reference, grouped_gemm2_reference

__all__ = ["Activation", "apply_activation", "grouped_gemm1_reference", "grouped_gemm2_reference"]
