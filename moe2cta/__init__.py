"""moe2cta: a Mixture-of-Experts layer for serving (placeholder, API filled in below)."""
from .grouped_gemm import Activation
from .router import RoutingConfig, Scoring
from .reference import RouterWeightOn, moe_reference, moe_forward_reference

__all__ = ["Activation", "RoutingConfig", "Scoring", "RouterWeightOn", "moe_reference", "moe_forward_reference"]
