"""Does the content of A's padding rows change the layer's speed? Graph-replay times of one MoE layer per content.

    python -m moe2cta.serving_bench.layer_padding_probe --models deepseek-v3 qwen3-235b-a22b --tokens 2048 8192

The CuTe path gathers the routed token rows into an expert-ordered A whose experts are padded to whole
tiles; the GEMMs multiply the padding rows and never read their outputs. `as-is` times the layer as it is
(GatherPadding.TOKEN_ROW on sm90 above the decode kernels' range; otherwise the padding rows keep what the
layer's own buffer held). The other contents hand the gather a buffer per rotated input whose padding rows
hold zeros (`zero`), N(0,1) values (`random`) or copies of a routed token's row (`copy`: hidden[0]), with
GatherPadding.LEAVE so that they stay. One graph per (content, input); all of them replay in interleaved
rounds (median per content). It also checks that every content gives bit-identical layer outputs. Needs a
CUDA GPU; a measurement tool, not part of the layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moe2cta import Backend, MoELayer, api
from moe2cta.presets import get_preset

from .backends import make_expert_weights, preset_layer
from .timing import interleaved_rounds

__all__ = ["main"]

CONTENTS = ("as-is", "zero", "random", "copy")
COPIES = 4  # rotated inputs per cell (their graphs replay round-robin, as in the layer benchmark)


def _buffers(content: str, rows: int, hidden: torch.Tensor) -> torch.Tensor | None:
    if content == "as-is":
        return None
    if content == "zero":
        return torch.zeros(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    if content == "random":
        return torch.randn(rows, hidden.shape[1], device=hidden.device).to(hidden.dtype)
    return hidden[:1].expand(rows, -1).contiguous()  # copy


def probe_cell(layer: MoELayer, preset, tokens: int, contents, rounds: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    inputs = [(torch.randn(tokens, preset.hidden, generator=gen).to(dev, torch.bfloat16),
               torch.randn(tokens, preset.num_experts, generator=gen).to(dev)) for _ in range(COPIES)]
    max_rows = tokens * preset.top_k + preset.num_experts * 256  # at least the dispatch's padded rows
    router = api._router_api()
    real_gather = router.gather
    current = {"out": None, "redirected": 0}

    def gather(hidden, disp, *args, **kwargs):
        if current["out"] is None or kwargs.get("out") is not None:
            return real_gather(hidden, disp, *args, **kwargs)
        current["redirected"] += 1
        rows = disp.sorted_slots.numel()  # the layer expects exactly the dispatch's rows
        kwargs["padding"] = router.GatherPadding.LEAVE  # keep the probe's content in the padding rows
        return real_gather(hidden, disp, *args, out=current["out"][:rows], **kwargs)

    graphs, outputs = {}, {}
    router.gather = gather
    try:
        for content in contents:
            for i, (hidden, logits) in enumerate(inputs):
                current["out"] = _buffers(content, max_rows, hidden)
                for _ in range(2):
                    layer(hidden, logits)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = layer(hidden, logits)
                graph.replay()
                torch.cuda.synchronize()
                graphs[content, i] = (graph, current["out"])  # (keep the buffer alive with its graph)
                outputs[content, i] = y.clone()
    finally:
        router.gather = real_gather
        current["out"] = None
    if current["redirected"] == 0:  # e.g. GEMM1 reads the token rows itself (ASource.TOKEN_ROWS): no gather at all
        return {"model": preset.name, "tokens": tokens, "runs": layer.backend_for(tokens).value,
                "not_applicable": "the layer runs no gather at this T: there are no padding rows to fill"}
    identical = all(torch.equal(outputs[c, i], outputs[contents[0], i]) for c in contents for i in range(COPIES))
    per_graph = interleaved_rounds({key: graph.replay for key, (graph, _) in graphs.items()}, rounds)
    med = {c: statistics.median(t for i in range(COPIES) for t in per_graph[c, i]) for c in contents}
    return {"model": preset.name, "tokens": tokens, "runs": layer.backend_for(tokens).value,
            "median_us": med, "identical_outputs": identical}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    parser.add_argument("--backend", default="cute", choices=[b.value for b in Backend])
    parser.add_argument("--contents", nargs="+", default=list(CONTENTS), choices=CONTENTS)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_padding_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    report = []
    for name in args.models:
        preset = get_preset(name)
        weights = make_expert_weights(preset, torch.device("cuda"), seed=0)
        layer = preset_layer(preset, weights, args.backend)
        for tokens in args.tokens:
            r = probe_cell(layer, preset, tokens, tuple(args.contents), args.rounds)
            report.append(r)
            if "not_applicable" in r:
                print(f"{name:16s} T={tokens:6d} ({r['runs']}): not applicable: {r['not_applicable']}", flush=True)
                continue
            base = r["median_us"][args.contents[0]]
            cells = "  ".join(f"{c} {us:9.1f} us ({us / base:.3f})" for c, us in r["median_us"].items())
            print(f"{name:16s} T={tokens:6d} ({r['runs']}): {cells}  identical outputs: {r['identical_outputs']}",
                  flush=True)
        del layer, weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r.get("identical_outputs", True) for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
