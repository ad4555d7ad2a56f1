"""moe2cta.router: routing (scoring + top-k), dispatch metadata, gather and combine."""
from .config import RoutingConfig, Scoring

__all__ = ["RoutingConfig", "Scoring"]
