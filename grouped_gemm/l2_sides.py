"""Which L2 partition ("side") each SM of a device reads through, for the DYNAMIC_SIDES scheduler.

A Hopper GPU's L2 is two partitions. Each caches lines for the SMs of the GPCs wired to it; a line that SMs of
both sides read is held twice and crosses the partition fabric. The DYNAMIC_SIDES scheduler (cute_backend.py)
cuts a GEMM's unit order into two halves, one per side, so that the units that share an operand tile (the
rasters put them next to each other) run on one side's SMs; a side whose half is done takes units of the other.

The kernel reads the side of its SM from its workspace: [0] first half's counter, [1] finish count, [2] second
half's counter, [3] unused, then SIDE_MAP_ENTRIES words, the side (0 or 1) of SM id i at 4 + i. A device's map is
set once (`set_side_map`, with the map serving_bench/l2_sides_probe.py measures on that chip); a device without one
gets all zeros, under which every SM takes the first half and then the second: exactly the DYNAMIC order.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SIDE_MAP_OFFSET", "SIDE_MAP_ENTRIES", "device_key", "set_side_map", "side_map", "clear_side_maps",
           "workspace_words", "launch_workspace"]

SIDE_MAP_OFFSET = 4  # cute_backend.SIDE_MAP_OFFSET (that module needs the DSL to import)
SIDE_MAP_ENTRIES = 256
_MAPS: dict = {}  # (device type, index) -> int32 [SIDE_MAP_ENTRIES] on that device
_RETURNED: dict = {}  # (device type, index) -> every map set_side_map made for it


def device_key(device) -> tuple:
    """(type, index) of `device`, "cuda" without an index meaning the current CUDA device: the key of every
    per-device table of the CuTe families, so that a device named either way finds the same entry."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device.type, device.index


def set_side_map(device, sides: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Record the side (0 or 1) of each SM id of `device` (sides[i]: SM id i; ids past the end: side 0) and return
    the device tensor that DYNAMIC_SIDES launches on that device read from now on (a new tensor each call: CUDA
    graphs captured earlier keep reading the map they were captured with). A tensor this function returned for the
    device is installed again as it is (no copy, no check: allowed while a CUDA graph is captured)."""
    if isinstance(sides, torch.Tensor) and any(sides is t for t in _RETURNED.get(device_key(device), ())):
        _MAPS[device_key(device)] = sides
        return sides
    values = torch.as_tensor(sides, dtype=torch.int64).flatten().cpu()
    if values.numel() > SIDE_MAP_ENTRIES:
        raise ValueError(f"sides: at most {SIDE_MAP_ENTRIES} SM ids, got {values.numel()}")
    if values.numel() and not bool(((values == 0) | (values == 1)).all()):
        raise ValueError(f"sides: expected 0 or 1 per SM id, got {sorted(set(values.tolist()))}")
    full = torch.zeros(SIDE_MAP_ENTRIES, dtype=torch.int32)
    full[: values.numel()] = values.to(torch.int32)
    tensor = full.to(torch.device(*device_key(device)))
    _MAPS[device_key(device)] = tensor
    _RETURNED.setdefault(device_key(device), []).append(tensor)
    return tensor


def side_map(device) -> torch.Tensor:
    """The map DYNAMIC_SIDES launches on `device` read (zeros, the DYNAMIC order, where none was set)."""
    key = device_key(device)
    if key not in _MAPS:
        _MAPS[key] = torch.zeros(SIDE_MAP_ENTRIES, dtype=torch.int32, device=torch.device(device))
    return _MAPS[key]


def clear_side_maps() -> None:
    """Forget every device's map (tests)."""
    _MAPS.clear()
    _RETURNED.clear()


def workspace_words(scheduler) -> int:
    """int32 words of a kernel's workspace under `scheduler` (an sm90_grouped_gemm.Scheduler)."""
    return SIDE_MAP_OFFSET + SIDE_MAP_ENTRIES if scheduler.value == "dynamic_sides" else 4


def launch_workspace(device) -> torch.Tensor:
    """A fresh DYNAMIC_SIDES workspace for one launch: zeroed counters, then the device's side map (one copy in
    stream order, so a CUDA graph holds it as a node and no state outlives a replay)."""
    sides = side_map(device)
    return torch.cat((torch.zeros(SIDE_MAP_OFFSET, dtype=torch.int32, device=sides.device), sides))
