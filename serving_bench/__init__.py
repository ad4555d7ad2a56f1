"""moe2cta.serving_bench: the serving latency benchmark (`moe2cta-bench`, `python -m moe2cta.serving_bench`).

One MoE layer, timed per backend beside its physical floor: decode and prefill sweeps over token counts,
and a serving trace (Poisson arrivals, continuous batching, per-step latency percentiles). Modules:
distributions (routing distributions), routing_twin (fp32 router twin with selection margins),
correctness (fp32 reference rows, tolerance), floors (ceilings, floor, targets), timing (CUDA graphs +
events, or a CPU clock), backends (peers and moe2cta adapters), trace (requests, scheduler, buckets),
runner (the loop, isolation), report / plots (terminal, JSON, Markdown, PNG), cli (arguments, defaults).
Importing this package needs no GPU; plots need matplotlib (the `bench` extra).
"""
