"""The `moe2cta` command: one entry point for the project's tools.

    moe2cta plan ...     the planner: chosen GEMM configurations and their resource budget (moe2cta.plan_cli)
    moe2cta aot ...      build a prebuilt CuTe kernel bundle for a model (moe2cta.aot)
    moe2cta tune ...     autotune GEMM configurations: build kernels here, time them on the GPU (moe2cta.tune_cli)
    moe2cta bench ...    the serving benchmark, same as `moe2cta-bench` (moe2cta.serving_bench.cli)
    moe2cta backends     which backends can run here, and why not

Each subcommand's module is imported only when that subcommand runs; a module missing from this build is
reported with a message and exit status 2, never a traceback.
"""
from __future__ import annotations

import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

# subcommand -> (module, what it does)
SUBCOMMANDS = {
    "plan": ("moe2cta.plan_cli", "plan GEMM configurations and print their resource budget"),
    "aot": ("moe2cta.aot", "build a prebuilt CuTe kernel bundle (MOE2CTA_KERNEL_DIR) for a model"),
    "tune": ("moe2cta.tune_cli", "autotune GEMM configurations (build kernels, then time them on the GPU)"),
    "bench": ("moe2cta.serving_bench.cli", "run the serving benchmark (same as moe2cta-bench)"),
}


def _usage() -> str:
    lines = ["usage: moe2cta {plan,aot,tune,bench,backends} [ARGS...]", "", "subcommands:"]
    for name, (_, what) in SUBCOMMANDS.items():
        lines.append(f"  {name:<9} {what}")
    lines.append(f"  {'backends':<9} show which backends (torch, triton, cute) can run on this machine")
    lines.append("")
    lines.append("`moe2cta SUBCOMMAND --help` shows a subcommand's options.")
    return "\n".join(lines)


def _backends(argv: list[str]) -> int:
    """Print, for a small bf16 layer on this machine's default device, what each backend says."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: moe2cta backends\n\nShow whether each backend can run a small bf16 layer here, and why not.")
        return 0
    if argv:
        print(f"usage: moe2cta backends\nmoe2cta backends: error: it takes no arguments, got {' '.join(argv)}",
              file=sys.stderr)
        return 2
    import torch

    from . import Backend, RoutingConfig, is_supported

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden = torch.zeros(1, 256, dtype=torch.bfloat16, device=device)
    w13 = torch.zeros(8, 256, 256, dtype=torch.bfloat16, device=device)
    w2 = torch.zeros(8, 256, 128, dtype=torch.bfloat16, device=device)
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    for backend in Backend:
        ok, reason = is_supported(backend, hidden, w13, w2, routing=RoutingConfig(top_k=2))
        print(f"  {backend.value:<7} {'yes' if ok else 'no '}  {reason}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a usage error: the usage goes to stderr
        print(_usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from . import __version__

        print(f"moe2cta {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "backends":
        return _backends(rest)
    if command not in SUBCOMMANDS:
        print(f"moe2cta: unknown subcommand {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"moe2cta {command}: {module_name} is not part of this build ({exc})", file=sys.stderr)
            return 2
        raise
    entry = getattr(module, "main", None)
    if entry is None:
        print(f"moe2cta {command}: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    result = entry(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
