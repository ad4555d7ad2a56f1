"""Measure which L2 partition ("side") each SM reads through, and write the side map DYNAMIC_SIDES launches use.

    python -m moe2cta.serving_bench.l2_sides_probe --out sides.json      # needs a CUDA GPU and nvcc

Builds and runs l2_sides_probe.cu (its comment says what it measures): four passes of first-touch L2 latency
against a reference SM (the first and the last block, twice each), and the SM ids of thread-block clusters (one
cluster always runs in one GPC). `sides_from_probe` splits the SMs of each pass at the widest gap between their
upper-quartile latencies (the SMs below it share the reference's side), aligns the passes with one another, and takes each
GPC's majority. The JSON it writes holds `side_of_sm` (index: SM id), the latency levels, the agreement between
passes and the GPCs; `--side-maps` of prefill_gemm_bench reads it. A measurement tool, not part of the layer.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile

__all__ = ["build_probe", "run_probe", "sides_from_probe", "builtin_side_map", "load_side_map", "main"]

SOURCE = pathlib.Path(__file__).with_name("l2_sides_probe.cu")
BUILTIN_MAPS = ("zero", "parity", "random", "low_high")
MAP_IDS = 144  # SM ids a builtin map covers (an H100 / H200 numbers its 132 SMs below 144)


def build_probe(out_path: str, nvcc: str = "nvcc") -> str:
    subprocess.run([nvcc, "-O2", "-gencode=arch=compute_90a,code=sm_90a", "-o", out_path, str(SOURCE)], check=True)
    return out_path


def run_probe(binary: str) -> dict:
    return json.loads(subprocess.run([binary], check=True, capture_output=True, text=True).stdout)


def _split(medians: dict[int, float]) -> tuple[set[int], float, float, float]:
    """SMs below the widest gap of the sorted medians, the two levels' medians and the gap."""
    ordered = sorted(medians.items(), key=lambda kv: kv[1])
    values = [v for _, v in ordered]
    gaps = [(values[i + 1] - values[i], i) for i in range(len(values) - 1)]
    gap, at = max(gaps) if gaps else (0.0, len(values) - 1)
    low = {sm for sm, _ in ordered[: at + 1]}
    return low, statistics.median(values[: at + 1]), statistics.median(values[at + 1:] or [float("nan")]), gap


def _gpcs(clusters: list[list[int]]) -> list[list[int]]:
    parent: dict[int, int] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for cluster in clusters:
        for sm in cluster:
            parent[find(sm)] = find(cluster[0])
    groups: dict[int, list[int]] = {}
    for sm in list(parent):
        groups.setdefault(find(sm), []).append(sm)
    return sorted(sorted(g) for g in groups.values())


def sides_from_probe(probe: dict) -> dict:
    """The side map and how clearly the probe shows it (see the module docstring)."""
    passes = []
    for p in probe["passes"]:
        # a block on the reference's side finds every line in its own partition; one on the other side finds some
        # (those whose home is the other partition) only across the fabric, so its upper quartile sits at the far
        # level while its median may fall either way (measured on the H200: 300 against 470 cycles)
        medians = {b["sm"]: float(b["q75"]) for b in p["blocks"]}
        reference_sm = p["blocks"][p["reference_block"]]["sm"]
        near, near_level, far_level, gap = _split(medians)
        if reference_sm not in near:  # the reference is on its own side by definition: the split is not sides
            near = {sm for sm in medians if sm not in near}
            near_level, far_level = far_level, near_level
        passes.append({"reference_sm": reference_sm, "near": near, "near_cycles": near_level,
                       "far_cycles": far_level, "gap_cycles": gap, "sms": set(medians)})
    sms = sorted(set().union(*(p["sms"] for p in passes)))
    first = passes[0]
    frame = {sm: 0 if sm in first["near"] else 1 for sm in sms}  # side 0: the first reference's side
    votes = {sm: [] for sm in sms}
    agreement = []
    for p in passes:
        labels = {sm: 0 if sm in p["near"] else 1 for sm in p["sms"]}
        same = sum(labels[sm] == frame[sm] for sm in labels) / len(labels)
        if same < 0.5:
            labels = {sm: 1 - v for sm, v in labels.items()}
            same = 1 - same
        agreement.append(same)
        for sm, v in labels.items():
            votes[sm].append(v)
    side = {sm: int(sum(v) * 2 > len(v)) if sum(v) * 2 != len(v) else frame[sm] for sm, v in votes.items()}
    gpcs = _gpcs(probe.get("clusters", []))
    split_gpcs = 0
    for gpc in gpcs:
        members = [sm for sm in gpc if sm in side]
        if not members:
            continue
        ones = sum(side[sm] for sm in members)
        split_gpcs += 0 < ones < len(members)
        majority = int(ones * 2 > len(members))
        for sm in members:
            side[sm] = majority
    side_of_sm = [side.get(i, 0) for i in range(max(sms) + 1)]
    return {
        "side_of_sm": side_of_sm,
        "sides": [sum(1 for sm in sms if side[sm] == s) for s in (0, 1)],
        "passes": [{k: v for k, v in p.items() if k not in ("near", "sms")} | {"near_sms": len(p["near"])}
                   for p in passes],
        "agreement": agreement,
        "gpcs": gpcs,
        "gpcs_split_by_latency": split_gpcs,
    }


def builtin_side_map(name: str, ids: int = MAP_IDS, seed: int = 0) -> list[int]:
    """Controls for DYNAMIC_SIDES: `zero` (every SM side 0: the DYNAMIC order), `parity` (SM id % 2), `low_high`
    (the lower half of the ids side 0) and `random` (half the ids on each side, shuffled with `seed`)."""
    if name == "zero":
        return [0] * ids
    if name == "parity":
        return [i % 2 for i in range(ids)]
    if name == "low_high":
        return [int(i >= ids // 2) for i in range(ids)]
    if name == "random":
        values = [i % 2 for i in range(ids)]
        random.Random(seed).shuffle(values)
        return values
    raise ValueError(f"name: expected one of {BUILTIN_MAPS}, got {name!r}")


def load_side_map(spec: str) -> list[int]:
    """A builtin map's name, or the path of a JSON this module wrote (its side_of_sm)."""
    if spec in BUILTIN_MAPS:
        return builtin_side_map(spec)
    path = pathlib.Path(spec)
    if not path.exists():
        raise ValueError(f"spec: expected one of {BUILTIN_MAPS} or a side-map JSON file, got {spec!r}")
    return [int(v) for v in json.loads(path.read_text())["side_of_sm"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON to write (the side map and the probe's raw readings)")
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--probe-json", help="analyse this raw probe output instead of running the probe")
    args = parser.parse_args(argv)
    if args.probe_json:
        probe = json.loads(pathlib.Path(args.probe_json).read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            probe = run_probe(build_probe(str(pathlib.Path(tmp) / "l2_sides_probe"), args.nvcc))
    result = sides_from_probe(probe)
    pathlib.Path(args.out).write_text(json.dumps(result | {"probe": probe}, indent=1))
    print(f"{probe.get('device')}: sides {result['sides']} (SMs), agreement between passes "
          f"{[round(a, 3) for a in result['agreement']]}, GPCs {[len(g) for g in result['gpcs']]}, "
          f"{result['gpcs_split_by_latency']} split by latency")
    for p in result["passes"]:
        print(f"  reference SM {p['reference_sm']:3d}: {p['near_sms']} near at {p['near_cycles']:.0f} cycles, "
              f"far {p['far_cycles']:.0f} cycles (gap {p['gap_cycles']:.0f})")
    print("  side_of_sm " + "".join(str(v) for v in result["side_of_sm"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
