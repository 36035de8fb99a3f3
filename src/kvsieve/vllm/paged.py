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


def _slots(table: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
           block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where slot ``slots[i]`` of request ``rows[i]`` sits (table: [R, blocks]): its block, its offset."""
    return table[rows, torch.div(slots, block_size, rounding_mode="floor")], slots % block_size


def block_table(block_ids: list) -> torch.Tensor:
    """[R, most blocks] int64: each request's blocks (a sequence of ids each), a shorter row padded
    with its own first block, which only its dead padding slots read."""
    most = max(len(ids) for ids in block_ids)
    return torch.tensor([list(ids) + [ids[0]] * (most - len(ids)) for ids in block_ids], dtype=torch.long)


def gather_rows(layout: Layout, kv_caches: list[torch.Tensor], table: torch.Tensor, live: torch.Tensor,
                values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of the first tokens of R requests in n layers, stacked layer-major: keys and values
    [n * R, H_kv, S, D] (values None unless asked).  table: [R, blocks] each request's blocks
    (``block_table``); live: [R, S] the slots each request holds (its first ones); the others
    are zero.

    Whole blocks are copied (one ``index_select`` a layer), then put in slot order in one copy.
    The keys are held as K^T, [n * R, H_kv, D, S] underneath (the returned keys are its transposed
    view), which the attention product reads without a copy and which vLLM's CPU blocks hold
    already (``CpuLayout``): gathering its keys token by token read them element by element,
    about 2 ms more a layer for 32 requests of 160 tokens on SmolLM2-135M's shape."""
    n, (R, blocks), S = len(kv_caches), table.shape, live.shape[-1]
    flat = table.flatten()  # [R * blocks]
    first_keys, first_values = layout.key_value(kv_caches[0])  # [N, H, block_size, D]
    _, H, block_size, D = first_keys.shape
    # [n, R * blocks, H, D, block_size]: each layer's blocks, keys transposed
    key_blocks = torch.empty(n, R * blocks, H, D, block_size, dtype=first_keys.dtype, device=first_keys.device)
    value_blocks = torch.empty(n, R * blocks, H, block_size, first_values.shape[-1], dtype=first_values.dtype,
                               device=first_values.device) if values else None
    for i, kv_cache in enumerate(kv_caches):
        keys_i, values_i = layout.key_value(kv_cache)
        torch.index_select(keys_i.transpose(2, 3), 0, flat, out=key_blocks[i])
        if values:
            torch.index_select(values_i, 0, flat, out=value_blocks[i])
    width = blocks * block_size
    keys_t = key_blocks.view(n, R, blocks, H, D, block_size).permute(0, 1, 3, 4, 2, 5) \
        .reshape(n * R, H, D, width)[..., :S]  # [n * R, H, D, S]
    value_rows = None if not values else value_blocks.view(n, R, blocks, H, block_size, -1) \
        .permute(0, 1, 3, 2, 4, 5).reshape(n * R, H, width, -1)[:, :, :S]  # [n * R, H, S, D]
    if not bool(live.all()):  # padding slots read as zero
        dead = ~live.repeat(n, 1)[:, None]  # [n * R, 1, S]
        keys_t.masked_fill_(dead[:, :, None], 0)
        if values:
            value_rows.masked_fill_(dead[..., None], 0)
    return keys_t.transpose(-1, -2), value_rows


def gather(layout: Layout, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the first ``length`` tokens of one request in one layer: keys, values [H_kv, length, D]."""
    keys, values = gather_rows(layout, [kv_cache], block_ids[None], torch.ones(1, length, dtype=torch.bool))
    return keys[0], values[0]


def move_slots(layout: Layout, kv_cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
               heads: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    """In place, in one gather and one scatter of one layer: slot ``dst[i]`` of kv head
    ``heads[i]`` of request ``rows[i]`` gets the key and value of its slot ``src[i]`` (indices
    [P], or that broadcast to one shape); table: [R, blocks] each request's blocks
    (``block_table``; requests hold disjoint blocks).  The sources are copied out before any
    slot is written, so a source may be overwritten freely."""
    key_cache, value_cache = layout.key_value(kv_cache)
    block_size = key_cache.shape[2]
    to_blk, to_off = _slots(table, rows, dst, block_size)
    from_blk, from_off = _slots(table, rows, src, block_size)
    key_cache[to_blk, heads, to_off] = key_cache[from_blk, heads, from_off]
    value_cache[to_blk, heads, to_off] = value_cache[from_blk, heads, from_off]


def compact_rows(layout: Layout, kv_cache: torch.Tensor, table: torch.Tensor, keep: torch.Tensor) -> None:
    """In place, in one gather and one scatter of one layer: kv head ``h`` of request ``r`` keeps
    its slots ``keep[r, h]`` ([R, H_kv, K], any order), moved to its first ``K`` slots in the order
    given; table: [R, blocks] each request's blocks."""
    R, H, K = keep.shape
    rows, heads, slots = (torch.arange(n, device=keep.device).view(shape) for n, shape in
                          ((R, (R, 1, 1)), (H, (1, H, 1)), (K, (1, 1, K))))  # broadcast to [R, H, K]
    move_slots(layout, kv_cache, table, rows, heads, slots, keep)


def write_(layout: Layout, kv_cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor) -> None:
    """In place: the request's first ``K`` slots of one layer get ``keys``, ``values`` [H_kv, K, D]
    (as vLLM's own cache write puts a request's tokens there)."""
    key_cache, value_cache = layout.key_value(kv_cache)
    H, K = keys.shape[:2]
    blk, off = _slots(block_ids[None], 0, torch.arange(K, device=keys.device)[None], key_cache.shape[2])  # [1, K]
    heads = torch.arange(H, device=keys.device)[:, None]
    key_cache[blk, heads, off] = keys
    value_cache[blk, heads, off] = values


def compact_(layout: Layout, kv_cache: torch.Tensor, block_ids: torch.Tensor, keep: torch.Tensor) -> None:
    """In place: each kv head ``h`` of one request keeps the tokens ``keep[h]`` ([H_kv, K], indices
    into the request's current KV, any order), moved to its first ``K`` slots in the order given."""
    compact_rows(layout, kv_cache, block_ids[None], keep[None])


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)
