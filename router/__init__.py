"""moe2cta.router: routing (scoring + top-k), dispatch metadata, gather and combine."""
from .api import (
    DispatchScheme,
    GatherPadding,
    RouterBackend,
    combine,
    dispatch,
    gather,
    route,
    route_dispatch,
    scatter_row_weights,
)
from .config import RoutingConfig, Scoring
from .reference import (
    DEFAULT_TILE_HEIGHTS,
    Dispatch,
    combine_reference,
    dispatch_reference,
    gather_reference,
    max_rows_for,
    route_reference,
)

__all__ = [
    "RoutingConfig",
    "Scoring",
    "RouterBackend",
    "DispatchScheme",
    "GatherPadding",
    "route",
    "dispatch",
    "route_dispatch",
    "gather",
    "scatter_row_weights",
    "combine",
    "Dispatch",
    "DEFAULT_TILE_HEIGHTS",
    "max_rows_for",
    "route_reference",
    "dispatch_reference",
    "gather_reference",
    "combine_reference",
]
