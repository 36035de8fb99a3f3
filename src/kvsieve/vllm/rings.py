"""Each live request's recent post-RoPE queries, recorded in vLLM's worker for the methods that
score with them (``attention.SieveCPUAttentionImpl`` records, ``store`` reads).  Plain torch, so
the compaction benchmark reads queries exactly as the worker does."""

from __future__ import annotations

import torch


class QueryRecorder:
    """The last ``window`` queries of every request slot in every layer, in one buffer
    [L, max_slots * H_q * window, D]: a ring per (layer, slot, head), head-major as scorers read
    queries ([R, H_q, n, D]), so ``rows`` of a run of layers is one index_select with no transposing
    or concatenating copy.  The model runner plans each step (``plan``: which query rows go to
    which ring entries); each layer then stores them with one index_copy_."""

    def __init__(self, layer_names: list[str], max_slots: int, window: int, num_heads: int, head_size: int,
                 dtype: torch.dtype):
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.window, self.num_heads = window, num_heads
        self.buffer = torch.zeros(len(layer_names), max_slots * num_heads * window, head_size, dtype=dtype)
        self.count = torch.zeros(max_slots, dtype=torch.long)  # queries seen per slot (ring position)
        self.slot_of: dict[str, int] = {}  # request -> its ring (stable while the request lives)
        self.free = list(range(max_slots - 1, -1, -1))
        self.src: torch.Tensor | None = None  # this step's query rows to record
        self.dst: torch.Tensor | None = None  # and where each row's heads go in each layer's buffer

    def slot(self, req_id: str) -> int:
        if req_id not in self.slot_of:
            self.slot_of[req_id] = slot = self.free.pop()
            self.count[slot] = 0
        return self.slot_of[req_id]

    def forget(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)

    def plan(self, req_ids: list[str], starts: list[int], ends: list[int]) -> None:
        """This step: request ``req_ids[i]`` has query rows ``starts[i]:ends[i]``; record the last
        ``window`` of them.  One Python pass per step, whatever the number of layers."""
        src, dst = [], []
        for req_id, start, end in zip(req_ids, starts, ends):
            slot = self.slot(req_id)
            first = max(start, end - self.window)
            seen = int(self.count[slot])
            for j, row in enumerate(range(first, end)):
                src.append(row)
                dst.append(slot * self.num_heads * self.window + (seen + j) % self.window)
            self.count[slot] = seen + (end - first)
        heads = torch.arange(self.num_heads) * self.window  # [H_q]: each head's ring within a slot
        self.src = torch.tensor(src, dtype=torch.long) if src else None
        self.dst = (torch.tensor(dst, dtype=torch.long)[:, None] + heads).flatten() if dst else None  # [T * H_q]

    def record(self, layer_name: str, query: torch.Tensor) -> None:
        """This step's queries [T, H_q, D] of one layer into its rings."""
        if self.src is None:
            return
        buffer = self.buffer[self.index[layer_name]]
        buffer.index_copy_(0, self.dst, query.index_select(0, self.src).reshape(-1, buffer.shape[-1]))  # [T * H_q, D]

    def held(self, req_id: str) -> int:
        """Queries the request's ring holds: all it has seen, up to ``window``."""
        return min(int(self.count[self.slot_of[req_id]]), self.window)

    def heads(self) -> int:
        """H_q, the query heads of each recorded query."""
        return self.num_heads

    def rows(self, layers: range, req_ids: list[str], n: int) -> torch.Tensor:
        """The last ``n`` recorded queries of each request in a run of layers, oldest first, in one
        index_select: [len(layers) * R, H_q, n, D], layer-major (each request holds at least ``n``:
        ``held``)."""
        slots = torch.tensor([self.slot_of[r] for r in req_ids], dtype=torch.long)  # [R]
        seen = self.count[slots][:, None]  # [R, 1]
        ring = (seen - n + torch.arange(n)[None]) % self.window  # [R, n]: the ring entries, oldest first
        heads = torch.arange(self.num_heads)[None, :, None] * self.window  # [1, H_q, 1]
        index = (slots[:, None] * self.num_heads * self.window)[:, None] + heads + ring[:, None]  # [R, H_q, n]
        per_layer = self.buffer.shape[1]
        index = torch.arange(layers.start, layers.stop)[:, None, None, None] * per_layer + index  # [n_l, R, H_q, n]
        flat = self.buffer.view(-1, self.buffer.shape[-1])
        return flat.index_select(0, index.flatten()).view(len(layers) * len(req_ids), self.num_heads, n, -1)
