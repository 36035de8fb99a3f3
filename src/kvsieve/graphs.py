"""A captured decode step: one token per row through the model, replayed from a CUDA graph.

Between compressions a bounded cache in static mode (``GenerateConfig.static_shapes``) keeps
every tensor at one address and shape: appends write into preallocated slots at each head's
``lengths`` (a device tensor), positions come from a device buffer, and an in-place eviction
(``SieveLayer.evict``) or a same-capacity compaction moves data without reallocating.  The
per-token forward is then the same sequence of kernels each step, so it is captured once with
``torch.cuda.CUDAGraph`` and replayed.

What the graph cannot see is host state.  ``SieveLayer.update`` advances the host-side bound
``max_len`` by one per call, so ``CapturedStep`` does that itself after each replay, and it
re-captures whenever a layer's storage changes (growth, a reallocating compaction, finished
rows leaving the batch): ``SieveLayer.storage()`` lists what a capture depends on.  A step
that would have to grow the cache runs eagerly.  Compression itself runs eagerly, between
replays, every ``interval`` steps.
"""

from __future__ import annotations

import torch

from .attention import StepState, cache_kwargs
from .cache import DEAD_POS, SieveCache


def forward_step(model, cache: SieveCache, input_ids: torch.Tensor, query_pos: torch.Tensor, observer):
    """One forward pass over the tokens in flight; returns the last position's logits [B, V]."""
    cache.begin_step(query_pos)
    state = StepState(cache=cache, query_pos=query_pos, observer=observer)
    rope_pos = query_pos.masked_fill(query_pos == DEAD_POS, 0)  # padding: any finite position
    out = model(input_ids=input_ids, position_ids=rope_pos, **cache_kwargs(model, cache),
                logits_to_keep=1, kvsieve=state)
    return out.logits[:, -1]


class CapturedStep:
    """``step(input_ids [B, 1], query_pos [B, 1]) -> logits [B, V]``, replayed from a CUDA graph."""

    def __init__(self, model, cache: SieveCache, observer):
        if model.device.type != "cuda":
            raise ValueError(f"cuda_graph needs the model on a CUDA device, not {model.device}; "
                             "drop cuda_graph (static_shapes alone works everywhere)")
        self.model, self.cache, self.observer = model, cache, observer
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.captured_for: tuple | None = None
        self.captures = 0  # how many times the step was (re)captured, for tests and benchmarks
        self.replays = 0
        self.disabled = False  # a capture rebound cache state: run eagerly from then on

    def _storage(self, batch: int) -> tuple:
        return (batch, *(layer.storage() for layer in self.cache.layers))

    def _fits(self) -> bool:
        return all(layer.max_len + 1 <= layer.capacity for layer in self.cache.layers)

    def __call__(self, input_ids: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        if self.disabled or not self._fits():  # the append must grow the cache: eager, then capture next time
            return forward_step(self.model, self.cache, input_ids, query_pos, self.observer)
        if self.captured_for != self._storage(input_ids.shape[0]):
            logits = forward_step(self.model, self.cache, input_ids, query_pos, self.observer)
            if self._fits():
                self._capture(input_ids, query_pos)
            return logits
        self.static_ids.copy_(input_ids)
        self.static_pos.copy_(query_pos)
        self.graph.replay()
        self.replays += 1
        for layer in self.cache.layers:  # the host half of SieveLayer.update
            layer.max_len += 1
        return self.static_logits

    def _capture(self, input_ids: torch.Tensor, query_pos: torch.Tensor) -> None:
        """Record one step; recording runs no kernel, and host state it touches is restored."""
        self.static_ids, self.static_pos = input_ids.clone(), query_pos.clone()
        max_lens = [layer.max_len for layer in self.cache.layers]
        before = self._storage(input_ids.shape[0])
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.static_logits = forward_step(self.model, self.cache, self.static_ids, self.static_pos, self.observer)
        for layer, n in zip(self.cache.layers, max_lens):
            layer.max_len = n
        if self._storage(input_ids.shape[0]) != before:
            # an observer or the model replaced a cache tensor instead of writing into it: a
            # replay would read the old tensor, so this policy cannot be captured
            import warnings

            warnings.warn("cuda_graph: the step rebinds cache state (a scorer's observe() assigns a new "
                          "tensor instead of updating in place); decoding continues eagerly", RuntimeWarning)
            self.disabled, self.graph = True, None
            return
        self.captured_for = before
        self.captures += 1
