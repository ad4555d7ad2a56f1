"""CUDA-graph capture that leaves the process as it found it when the capture fails (used by GraphedMoELayer, the
tuner and the benchmark's timing, which all fall back to eager work or report the error after a failed capture)."""
from __future__ import annotations

import contextlib
import warnings

import torch

__all__ = ["capture_cuda_graph"]


@contextlib.contextmanager
def capture_cuda_graph(graph: torch.cuda.CUDAGraph, *, pool=None, stream: torch.cuda.Stream | None = None):
    """`torch.cuda.graph(graph, pool=pool, stream=stream)` that leaves the process as it found it when the capture
    fails.

    A capture that is invalidated (a host sync inside it, or another operation a capture does not allow) makes
    torch.cuda.graph's exit raise from capture_end, before it makes the caller's stream current again and, in
    torch 2.11, before the default CUDA generator leaves capture mode: every later random draw from it on that
    device then raises "Offset increment outside graph capture encountered unexpectedly". On any exception this
    makes the caller's stream current again, runs an empty capture (which ends normally and so takes the generator
    out of capture mode), and lets the exception propagate (the original one also when that cleanup cannot run).
    """
    previous = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    except BaseException:
        try:
            torch.cuda.set_stream(previous)
            with torch.cuda.device(previous.device), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the graph is empty
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    pass
        except Exception:  # a device that cannot capture now (a sticky error): the original exception says why
            pass
        raise
