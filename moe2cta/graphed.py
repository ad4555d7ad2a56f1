"""GraphedMoELayer: a MoELayer replayed from CUDA graphs, one per batch size, for callers that run it eagerly.

Why: an eager forward costs 0.2-1.1 ms of host time on the H200 machine (Triton's launch path for the router,
gather and combine kernels, the GEMM calls, the layer's checks: serving_bench/results/sustained-clock-h200-2026-12-02),
4-12x the GPU time of a decode step. Serving engines capture the layer in their own CUDA graphs and pay none of it;
this wrapper gives a caller without such machinery the same: one replay and a few small copies per call (measured:
serving_bench/results/graphed-host-h200-2026-12-02).

How a call runs (T tokens):
- T in 1..max(batch_sizes): the graph of the smallest batch size S >= T takes it. The inputs are copied into static buffers
  (rows 0..T-1), rows T..S-1 are padding, the graph of size S replays, and rows 0..T-1 of its output are returned.
  A padding row is a zero hidden row routed like token 0 (token 0's router logits; or its top-k ids with weight 0),
  so padding adds rows to experts the batch already reads and no weight bytes: at decode sizes the layer streams
  weights, and zero logits would pull in k more experts. Zero rows are written only where an earlier call left
  other data; token 0's routing is copied into rows T..S-1 on every call with T < S. So a call launches the input
  copies, that one copy, the replay and (COPY) the output copy. Padding never reaches the result of a real token,
  and the kernels that run are the ones the layer picks for S tokens.
- Inputs written in place: `static_inputs(T)` returns views of rows 0..T-1 of the static buffers; a caller that
  writes its batch there (e.g. as the `out=` of the op before) and passes those views is not copied from. With
  GraphOutput.STATIC_BUFFER such a call launches only the replay (and the padding copies when T < S).
- T == 0 or T > max(batch_sizes): the layer runs eagerly (`eager_calls` counts these).
- The graph of a size is captured when it is first needed, or ahead of time by `capture()`; each capture first
  runs the forward twice on a side stream, so that Triton compiles and CuTe kernels load outside the capture. All
  graphs share one memory pool (captured largest first by `capture()`), as CUDA-graph serving engines do.

Equivalence: a call returns what `layer(...)` returns on the padded batch (rows 0..T-1), bit for bit (GPU tests).
What a graph holds by address, so must stay in place: the layer's weights, biases, expert map and prepared (packed)
tensors. Weights updated in place (`w.copy_(new)`) are seen by the next replay; rebinding a layer attribute to a
new tensor is not (build a new GraphedMoELayer). Replays run on the caller's current stream; a GraphedMoELayer is
not for concurrent use from two streams or threads (its static buffers are shared by every call), and a capture
(`capture()` ahead of time, or the first call of a size) synchronizes the device: capture while no other thread
runs CUDA work. Each graph is captured on a stream of the layer's device, whichever device was current before.
Inference only: inputs are copied in without autograd history, and the output carries none (a graph replay is
invisible to autograd), so inputs that require grad neither keep their graphs alive nor get gradients.
"""
from __future__ import annotations

import bisect
import enum

import torch

from .api import MoELayer
from .capture import capture_cuda_graph
from .config import Backend, IdCheck
from .router.config import parse_enum
from .validation import FLOAT_DTYPES, INT_DTYPES, require_tensor

__all__ = ["GraphInputs", "GraphOutput", "GraphedMoELayer", "capture_size_for", "padding_rows"]


class GraphInputs(enum.Enum):
    """What a call of a GraphedMoELayer is given beside hidden [T, H]."""

    ROUTER_LOGITS = "router_logits"  # router_logits [T, E_g]: the layer routes (needs the layer's routing)
    TOPK = "topk"  # precomputed topk_weights [T, k] (float) and topk_ids [T, k] (int32 / int64)

    @classmethod
    def parse(cls, value: "GraphInputs | str") -> "GraphInputs":
        return parse_enum(cls, value, "inputs")


class GraphOutput(enum.Enum):
    """What a call returns."""

    COPY = "copy"  # a new [T, H] tensor (one copy kernel): the caller may keep it
    STATIC_BUFFER = "static_buffer"  # a view of the graph's output buffer: valid until the next call replays

    @classmethod
    def parse(cls, value: "GraphOutput | str") -> "GraphOutput":
        return parse_enum(cls, value, "output")


def capture_size_for(num_tokens: int, batch_sizes: tuple[int, ...]) -> int | None:
    """The captured batch size that runs num_tokens tokens: the smallest of the sorted `batch_sizes` >= num_tokens;
    None where the layer runs eagerly (num_tokens == 0 or above every captured size)."""
    if num_tokens == 0:
        return None
    index = bisect.bisect_left(batch_sizes, num_tokens)
    return batch_sizes[index] if index < len(batch_sizes) else None


def padding_rows(num_tokens: int, size: int, dirty_rows: int) -> tuple[int, int, int]:
    """(start, end, dirty_rows after the call) for a call of num_tokens tokens on the graph of `size`: rows start..end-1
    of the static inputs are written as padding before the replay. dirty_rows: rows >= it already hold padding
    (rows below it may hold an earlier call's tokens). Afterwards rows num_tokens..size-1 hold padding."""
    end = max(num_tokens, min(dirty_rows, size))
    return num_tokens, end, (dirty_rows if dirty_rows > size else num_tokens)


def _parse_batch_sizes(batch_sizes) -> tuple[int, ...]:
    try:
        sizes = tuple(batch_sizes)
    except TypeError:
        raise TypeError(f"batch_sizes: expected a sequence of ints >= 1, got {type(batch_sizes).__name__}") from None
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"batch_sizes: expected a non-empty sequence of ints >= 1, got {batch_sizes!r}")
    return tuple(sorted(set(sizes)))


class GraphedMoELayer:
    """layer (a MoELayer on a CUDA device, TRITON / CUTE / AUTO backend) replayed from one CUDA graph per batch size.

    batch_sizes: the token counts to capture (a call of T tokens runs the smallest one >= T; see the module
    docstring). inputs: GraphInputs.ROUTER_LOGITS (call as graphed(hidden, router_logits)) or TOPK (call as
    graphed(hidden, topk_weights=..., topk_ids=...), with top_k slots: the layer's routing's unless given).
    output: GraphOutput.COPY (default) or STATIC_BUFFER (no copy; the view is overwritten by the next call).
    Inference only, one stream or thread at a time (module docstring).
    """

    def __init__(
        self,
        layer: MoELayer,
        batch_sizes,
        *,
        inputs: GraphInputs | str = GraphInputs.ROUTER_LOGITS,
        output: GraphOutput | str = GraphOutput.COPY,
        top_k: int | None = None,
    ):
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer: expected a MoELayer, got {type(layer).__name__}")
        self.layer = layer
        self.batch_sizes = _parse_batch_sizes(batch_sizes)
        self.inputs = GraphInputs.parse(inputs)
        self.output = GraphOutput.parse(output)
        if self.inputs is GraphInputs.ROUTER_LOGITS:
            if layer.config.routing is None:
                raise ValueError("inputs: router_logits needs a layer built with a routing; pass inputs='topk'")
            if top_k is not None:
                raise ValueError("top_k: only for inputs='topk' (router_logits routes with the layer's top_k)")
            top_k = layer.config.top_k
        elif top_k is None:
            if layer.config.top_k is None:
                raise ValueError("top_k: this layer has no routing, pass the number of slots of topk_ids")
            top_k = layer.config.top_k
        elif isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= layer.num_global_experts:
            raise ValueError(f"top_k: expected an int in [1, {layer.num_global_experts}] (the experts), got {top_k!r}")
        elif layer.config.top_k is not None and top_k != layer.config.top_k:
            raise ValueError(f"top_k: the layer routes top_k={layer.config.top_k} (its routing), so topk_ids have that "
                             f"many slots; got {top_k}")
        self.top_k = top_k
        if layer.id_check is IdCheck.CHECK:
            raise ValueError("layer: id_check=check reads topk_ids / expert_map back to the host and cannot be "
                             "captured; build the MoELayer with id_check auto or skip")
        device = layer.w13.device
        if device.type != "cuda":
            raise ValueError(f"layer: CUDA graphs need a layer on a CUDA device, got its weights on {device}")
        if Backend.TORCH in layer.plan.backends:
            raise ValueError("layer: the torch backend reads routing back to the host and cannot be captured; "
                             f"build the MoELayer with backend triton, cute or auto (it runs {layer.backend.value})")
        rows = self.batch_sizes[-1]
        # Static inputs, one buffer for every size (graphs capture views of its first S rows), allocated outside
        # the graphs' pool. `_zero_padded`: zero in padding rows (`_dirty_rows`: rows >= it are zero);
        # `_token0_padded`: token 0's row in padding rows. Before the first call: zeros, and ids 0..k-1.
        self._hidden = torch.zeros(rows, layer.hidden_size, dtype=layer.w13.dtype, device=device)
        if self.inputs is GraphInputs.ROUTER_LOGITS:
            self._logits = torch.zeros(rows, layer.num_global_experts, dtype=torch.float32, device=device)
            self._routing_buffers = (self._logits,)
            self._zero_padded = (self._hidden,)
            self._token0_padded = (self._logits,)
        else:
            self._weights = torch.zeros(rows, top_k, dtype=torch.float32, device=device)
            # int64 ids: a caller's int32 or int64 ids are copied in exactly (the kernels read int64 as given)
            self._ids = torch.arange(top_k, dtype=torch.int64, device=device).expand(rows, top_k).contiguous()
            self._routing_buffers = (self._weights, self._ids)
            self._zero_padded = (self._hidden, self._weights)
            self._token0_padded = (self._ids,)
        self._dirty_rows = 0
        self._pool = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager_calls = 0

    def __repr__(self) -> str:
        return (f"GraphedMoELayer(batch_sizes={self.batch_sizes}, inputs={self.inputs.value}, "
                f"output={self.output.value}, captured={sorted(self._graphs)}, layer={self.layer!r})")

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self, batch_sizes=None) -> None:
        """Capture the graphs of `batch_sizes` (default: every size of this layer) not captured yet, largest first."""
        sizes = self.batch_sizes if batch_sizes is None else _parse_batch_sizes(batch_sizes)
        unknown = [s for s in sizes if s not in self.batch_sizes]
        if unknown:
            raise ValueError(f"batch_sizes: {unknown} are not among this layer's sizes {self.batch_sizes}")
        for size in sorted(sizes, reverse=True):
            if size not in self._graphs:
                self._capture(size)

    def static_inputs(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Views of rows 0..num_tokens-1 of the static inputs: (hidden, router_logits) or (hidden, topk_weights,
        topk_ids), in the order of a call's arguments. Write a batch into them and call with them: no input copy
        (graphed(hidden, router_logits), or graphed(hidden, topk_weights=..., topk_ids=...): those two are
        keyword-only). Every call writes these buffers, so fill them right before the call."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= self.batch_sizes[-1]:
            raise ValueError(f"num_tokens: expected an int in [1, {self.batch_sizes[-1]}] (the largest batch size), "
                             f"got {num_tokens!r}")
        return tuple(buffer[:num_tokens] for buffer in (self._hidden, *self._routing_buffers))

    def _forward_static(self, size: int) -> torch.Tensor:
        if self.inputs is GraphInputs.ROUTER_LOGITS:
            return self.layer(self._hidden[:size], self._logits[:size])
        return self.layer(self._hidden[:size], topk_weights=self._weights[:size], topk_ids=self._ids[:size])

    def _capture(self, size: int) -> None:
        device = self._hidden.device
        with torch.cuda.device(device):
            # the forwards run on what the static inputs hold (zeros and ids 0..k-1 at first, else earlier calls' rows
            # or a batch written in place for this call, which stays): their values do not change what is captured
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles / loads every kernel of this size outside the capture
                    self._forward_static(size)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # on `side`, a stream of the layer's device: torch.cuda.graph's own default stream is made once per
            # process, on whichever device was current at the first capture anywhere
            with capture_cuda_graph(graph, pool=self._pool, stream=side):
                out = self._forward_static(size)
            torch.cuda.synchronize()
        self._graphs[size] = (graph, out)

    def _check_inputs(self, hidden, router_logits, topk_weights, topk_ids) -> int:
        require_tensor("hidden", hidden, ndim=2)
        if hidden.dtype != self._hidden.dtype:
            raise TypeError(f"hidden: expected dtype {self._hidden.dtype} (the layer's weights), got {hidden.dtype}")
        num_tokens = hidden.shape[0]
        expected = [("hidden", hidden, self._hidden)]
        if self.inputs is GraphInputs.ROUTER_LOGITS:
            if topk_weights is not None or topk_ids is not None:
                raise ValueError("topk_weights / topk_ids: this GraphedMoELayer takes router_logits (inputs='router_logits')")
            expected.append(("router_logits", require_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES),
                             self._logits))
        else:
            if router_logits is not None:
                raise ValueError("router_logits: this GraphedMoELayer takes topk_weights / topk_ids (inputs='topk')")
            expected.append(("topk_weights", require_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES),
                             self._weights))
            expected.append(("topk_ids", require_tensor("topk_ids", topk_ids, ndim=2, dtypes=INT_DTYPES), self._ids))
        for name, tensor, static in expected:
            if tensor.shape[0] != num_tokens or tensor.shape[1] != static.shape[1]:
                raise ValueError(f"{name}: expected shape ({num_tokens}, {static.shape[1]}), got {tuple(tensor.shape)}")
            if tensor.device != static.device:
                raise ValueError(f"{name}: expected a tensor on {static.device} (the layer's device), got {tensor.device}")
        return num_tokens

    def __call__(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_weights: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [T, H] + router_logits [T, E_g] (or topk_weights / topk_ids [T, k]) -> out [T, H]."""
        num_tokens = self._check_inputs(hidden, router_logits, topk_weights, topk_ids)
        size = capture_size_for(num_tokens, self.batch_sizes)
        if size is None:
            self.eager_calls += 1
            return self.layer(hidden, router_logits, topk_weights=topk_weights, topk_ids=topk_ids)
        if torch.cuda.current_device() != self._hidden.device.index:
            raise ValueError(f"hidden: replays run on the current CUDA device, cuda:{torch.cuda.current_device()}; make "
                             f"the layer's device, {self._hidden.device}, current (torch.cuda.set_device)")
        if size not in self._graphs:
            self._capture(size)
        sources = (router_logits,) if self.inputs is GraphInputs.ROUTER_LOGITS else (topk_weights, topk_ids)
        return self._replay(size, num_tokens, hidden, sources)

    @torch.no_grad()  # inference only: no autograd history on the static buffers (module docstring)
    def _replay(self, size: int, num_tokens: int, hidden: torch.Tensor, sources: tuple) -> torch.Tensor:
        """Copy the batch into the static buffers, write the padding rows, replay the graph of `size`."""
        for buffer, source in zip((self._hidden, *self._routing_buffers), (hidden, *sources)):
            static_rows = buffer[:num_tokens]
            if (source.data_ptr(), source.dtype, source.stride()) != (static_rows.data_ptr(), static_rows.dtype,
                                                                       static_rows.stride()):
                static_rows.copy_(source)  # (a view from static_inputs() is in place already)
        # rows num_tokens..size-1 must hold padding: zero rows only where an earlier call wrote, token 0's always
        start, end, self._dirty_rows = padding_rows(num_tokens, size, self._dirty_rows)
        if start < end:
            for buffer in self._zero_padded:
                buffer[start:end].zero_()
        if num_tokens < size:
            for buffer in self._token0_padded:
                buffer[num_tokens:size].copy_(buffer[:1].expand(size - num_tokens, -1))
        graph, out = self._graphs[size]
        graph.replay()
        rows = out[:num_tokens]
        return rows.clone() if self.output is GraphOutput.COPY else rows
