"""Paged KV compaction: read a request's KV out of vLLM's blocks and move each kv head's kept
tokens into the request's first slots, in place.  Plain torch: no vLLM import, so the main test
suite checks it without vLLM.

A *layout* turns one layer's KV cache tensor into two views, keys and values, each shaped
``[num_blocks, num_kv_heads, block_size, head_size]``; gathers and scatters are written once
against that shape.  Token ``t`` of a request whose block table is ``block_ids`` sits at block
``block_ids[t // block_size]``, offset ``t % block_size``.

Every (layer, kv head) of a request keeps the same number of tokens (one block table per request
is shared by all heads and layers: AMS Appendix E), but each head keeps its own tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Layout(Protocol):
    name: str

    def key_value(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of one layer's keys and values, each [num_blocks, H_kv, block_size, D]."""
        ...


class CpuLayout:
    """vLLM's CPU attention backend (``v1/attention/backends/cpu_attn.py``) with its ``vec`` and
    ``vec16`` kernels (x86 without AMX, fp32/fp16/bf16): one tensor ``[num_blocks, H_kv, block_size,
    2 * D]`` per layer, whose last two dimensions are not (token, k|v).  Per (block, head) it holds
    ``2 * block_size * D`` values: the block's keys **column-major**, ``[D, block_size]`` (token
    ``t``'s dimension ``i`` at ``i * block_size + t``), then its values row-major, ``[block_size, D]``
    (``reshape_and_cache`` in csrc/cpu/cpu_attn_vec.hpp; vec16 inherits it).  The AMX and ARM
    kernels pack their blocks differently: refused (``for_isa``)."""

    name = "cpu"
    ISAS = ("vec", "vec16")

    def key_value(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h, bs, two_d = kv_cache.shape
        d = two_d // 2
        halves = kv_cache.view(n, h, 2, bs * d)
        keys = halves[:, :, 0].view(n, h, d, bs).transpose(2, 3)
        values = halves[:, :, 1].view(n, h, bs, d)
        return keys, values

    @classmethod
    def for_isa(cls, isa: str) -> "CpuLayout":
        if isa not in cls.ISAS:
            raise ValueError(f"kvsieve: vLLM's CPU attention kernel {isa!r} packs its KV blocks in a layout "
                             f"kvsieve does not read yet; supported: {', '.join(cls.ISAS)}")
        return cls()


class FlashAttnLayout:
    """FlashAttention-style ``[2, num_blocks, block_size, H_kv, D]`` (GPU backends; untested here)."""

    name = "flash"

    def key_value(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0].permute(0, 2, 1, 3), kv_cache[1].permute(0, 2, 1, 3)


LAYOUTS = {"cpu": CpuLayout(), "flash": FlashAttnLayout()}


def _slots(block_ids: torch.Tensor, idx: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return block_ids[torch.div(idx, block_size, rounding_mode="floor")], idx % block_size


def block_table(block_ids: list) -> torch.Tensor:
    """[R, most blocks] int64: each request's blocks (a sequence of ids each), a shorter row padded
    with its own first block, which only its dead padding slots read."""
    most = max(len(ids) for ids in block_ids)
    return torch.tensor([list(ids) + [ids[0]] * (most - len(ids)) for ids in block_ids], dtype=torch.long)


def gather_rows(layout: Layout, kv_cache: torch.Tensor, table: torch.Tensor, live: torch.Tensor,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the first tokens of R requests in one layer, in one gather: keys, values
    [R, H_kv, S, D], written into ``out`` when given (two such tensors, e.g. one layer's part of
    a stack of layers).  table: [R, blocks] each request's blocks (``block_table``); live: [R, S]
    the slots each request holds (its first ones); the others are zero.  (Whole blocks by
    ``index_select`` instead of tokens measured no faster here: 1.1 against 1.0 ms for 16
    requests of 160 tokens on SmolLM2-135M's shape.)"""
    keys, values = layout.key_value(kv_cache)
    block_size = keys.shape[2]
    idx = torch.arange(live.shape[-1]).expand_as(live).masked_fill(~live, 0)  # [R, S]: padding reads slot 0
    blk, off = table.gather(-1, torch.div(idx, block_size, rounding_mode="floor")), idx % block_size
    keys, values = keys[blk, :, off].transpose(1, 2), values[blk, :, off].transpose(1, 2)  # [R, H, S, D]
    if out is not None:
        keys, values = out[0].copy_(keys), out[1].copy_(values)
    if not bool(live.all()):  # padding slots read as zero
        dead = ~live[:, None, :, None]
        keys, values = keys.masked_fill_(dead, 0), values.masked_fill_(dead, 0)
    return keys, values


def gather(layout: Layout, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the first ``length`` tokens of one request in one layer: keys, values [H_kv, length, D]."""
    keys, values = gather_rows(layout, kv_cache, block_ids[None], torch.ones(1, length, dtype=torch.bool))
    return keys[0], values[0]


def write_rows(layout: Layout, kv_cache: torch.Tensor, table: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> None:
    """In place, in one scatter: request ``r``'s first ``K`` slots of one layer get ``keys[r]``,
    ``values[r]`` ([R, H_kv, K, D]); table: [R, blocks] each request's blocks (``block_table``;
    requests hold disjoint blocks)."""
    R, H, K = keys.shape[:3]
    rows, heads, slots = (torch.arange(n, device=keys.device).view(shape) for n, shape in
                          ((R, (R, 1, 1)), (H, (1, H, 1)), (K, (1, 1, K))))  # broadcast to [R, H, K]
    write_slots(layout, kv_cache, table, rows, heads, slots, keys, values)


def write_slots(layout: Layout, kv_cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor,
                slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """In place, in one scatter: slot ``slots[i]`` of kv head ``heads[i]`` of request ``rows[i]``
    gets ``keys[i]``, ``values[i]`` ([P, D]; or indices that broadcast to one shape, [..., D]);
    table: [R, blocks] each request's blocks."""
    key_cache, value_cache = layout.key_value(kv_cache)
    block_size = key_cache.shape[2]
    blk = table[rows, torch.div(slots, block_size, rounding_mode="floor")]  # [P]
    off = slots % block_size
    key_cache[blk, heads, off] = keys
    value_cache[blk, heads, off] = values


def write_(layout: Layout, kv_cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor) -> None:
    """In place: the request's first ``K`` slots of one layer get ``keys``, ``values`` [H_kv, K, D]."""
    write_rows(layout, kv_cache, block_ids[None], keys[None], values[None])


def compact_(layout: Layout, kv_cache: torch.Tensor, block_ids: torch.Tensor, keep: torch.Tensor) -> None:
    """In place: each kv head ``h`` keeps the tokens ``keep[h]`` ([H_kv, K], indices into the request's
    current KV, any order), moved to the request's first ``K`` slots in the order given.  The kept
    tokens are copied out before any slot is written, so a source slot may be overwritten freely."""
    keys, values = layout.key_value(kv_cache)
    num_heads, k = keep.shape
    heads = torch.arange(num_heads, device=keep.device)[:, None].expand(num_heads, k)
    blk, off = _slots(block_ids, keep, keys.shape[2])
    write_(layout, kv_cache, block_ids, keys[blk, heads, off], values[blk, heads, off])  # [H, K, D] copies


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)
