"""stop 49 probe: where a Triton JIT launch of the layer's own kernels spends its host time (Triton 3.6).

Records every JITFunction.run of one eager forward, then times each recorded launch 200 times behind a GPU sleep:
the whole JIT launch, and its phases (binder, cache key, the compiled kernel's runner with the bound arguments).
"""
import statistics
import sys
import time

import torch
from triton.runtime import jit as tjit
from triton.runtime.driver import driver

from moe2cta import MoELayer
from moe2cta.presets import get_preset
from moe2cta.serving_bench.backends import make_expert_weights


def per_call(fn, calls=200, rounds=5):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000 * calls)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(1e6 * (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return statistics.median(out)


def main(model, tokens, backend):
    preset = get_preset(model)
    dev = torch.device("cuda")
    w = make_expert_weights(preset, dev, seed=0)
    layer = MoELayer(w.w13, w.w2, routing=preset.routing, activation=preset.activation, b13=w.b13, b2=w.b2,
                     e_score_correction_bias=w.e_score_correction_bias, backend=backend)
    hidden = torch.randn(tokens, preset.hidden, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(tokens, preset.num_experts, device=dev)
    layer(hidden, logits)
    torch.cuda.synchronize()
    recorded = []
    original = tjit.JITFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, dict(kwargs), grid))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    tjit.JITFunction.run = recording
    layer(hidden, logits)
    tjit.JITFunction.run = original
    torch.cuda.synchronize()
    print(f"{model} T={tokens} {backend}: {len(recorded)} launches")
    for fn, args, kwargs, grid in recorded:
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        kernel_cache, kernel_key_cache, target, backend_obj, binder = fn.device_caches[device]
        kw = dict(kwargs)
        kw["debug"] = False
        kw["instrumentation_mode"] = tjit.knobs.compilation.instrumentation_mode
        kw["fpsan_homomorphic_casts"] = getattr(tjit.knobs.compilation, "fpsan_homomorphic_casts", None)
        if kw["fpsan_homomorphic_casts"] is None:
            kw.pop("fpsan_homomorphic_casts")
        bound, spec, opts = binder(*args, **kw)
        key = tjit.compute_cache_key(kernel_key_cache, spec, opts)
        compiled = kernel_cache[key]
        g = grid if not callable(grid) else grid(bound)
        g3 = tuple(g) + (1,) * (3 - len(g))
        values = list(bound.values())
        runner = compiled[g3]
        t_full = per_call(lambda: fn[grid](*args, **kwargs))
        t_bind = per_call(lambda: binder(*args, **kw))
        t_key = per_call(lambda: tjit.compute_cache_key(kernel_key_cache, spec, opts))
        t_run = per_call(lambda: runner(*values, stream=stream))
        t_knobs = per_call(lambda: (tjit.knobs.runtime.debug, tjit.knobs.compilation.instrumentation_mode))
        t_dev = per_call(lambda: driver.active.get_current_stream(driver.active.get_current_device()))
        n_const = sum(1 for p in fn.params if p.is_constexpr)
        print(f"  {fn.fn.__name__:34s} params {len(fn.params):3d} (constexpr {n_const:2d}) globals {len(fn.used_global_vals):3d}"
              f" | full {t_full:6.1f} | binder {t_bind:6.1f} | key {t_key:5.1f} | runner {t_run:5.1f}"
              f" | knobs {t_knobs:4.1f} | dev+stream {t_dev:4.1f} us")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
