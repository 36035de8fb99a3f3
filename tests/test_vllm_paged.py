"""Paged compaction (kvsieve.vllm.paged) against a dense reference, in vLLM's CPU layout and the
FlashAttention layout: plain torch, no vLLM needed."""

import pytest
import torch

from kvsieve.vllm.paged import LAYOUTS, block_table, blocks_for, compact_, compact_rows, gather, gather_rows

H, D, BS, NUM_BLOCKS = 3, 8, 4, 16


def _paged(layout: str, dense_k: torch.Tensor, dense_v: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """A KV cache tensor for ``layout`` holding one request's dense [H, T, D] keys and values in
    ``block_ids``, every other slot filled with noise."""
    torch.manual_seed(1)
    if layout == "cpu":
        cache = torch.randn(NUM_BLOCKS, H, BS, 2 * D)
    else:
        cache = torch.randn(2, NUM_BLOCKS, BS, H, D)
    keys, values = LAYOUTS[layout].key_value(cache)
    for t in range(dense_k.shape[1]):
        keys[block_ids[t // BS], :, t % BS] = dense_k[:, t]
        values[block_ids[t // BS], :, t % BS] = dense_v[:, t]
    return cache


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_gather_reads_the_request_in_token_order(layout):
    T = 11
    k, v = torch.randn(H, T, D), torch.randn(H, T, D)
    block_ids = torch.tensor([7, 2, 12])  # scattered, out of order
    cache = _paged(layout, k, v, block_ids)
    gk, gv = gather(LAYOUTS[layout], cache, block_ids, T)
    assert torch.equal(gk, k) and torch.equal(gv, v)


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_compact_moves_each_heads_tokens_to_the_first_slots(layout):
    T, K = 11, 5
    k, v = torch.randn(H, T, D), torch.randn(H, T, D)
    block_ids = torch.tensor([7, 2, 12])
    cache = _paged(layout, k, v, block_ids)
    other = cache.clone()
    # each head keeps its own tokens; overlapping sources and destinations on purpose
    keep = torch.stack([torch.tensor([0, 1, 2, 3, 4]), torch.tensor([10, 9, 3, 0, 6]), torch.tensor([1, 5, 7, 8, 10])])
    compact_(LAYOUTS[layout], cache, block_ids, keep)
    gk, gv = gather(LAYOUTS[layout], cache, block_ids, K)
    heads = torch.arange(H)[:, None]
    assert torch.equal(gk, k[heads, keep]) and torch.equal(gv, v[heads, keep])
    # blocks of other requests are untouched
    untouched = [b for b in range(NUM_BLOCKS) if b not in block_ids.tolist()]
    if layout == "cpu":
        assert torch.equal(cache[untouched], other[untouched])
    else:
        assert torch.equal(cache[:, untouched], other[:, untouched])


def _requests(layout: str, lengths: list[int], blocks: list[list[int]], layers: int):
    """``layers`` caches holding requests of ``lengths`` tokens in ``blocks``, and each request's
    dense keys and values per layer ([H, T, D] each), written token by token."""
    torch.manual_seed(2)
    caches, dense = [], []
    for _ in range(layers):
        cache = torch.randn(NUM_BLOCKS, H, BS, 2 * D) if layout == "cpu" else torch.randn(2, NUM_BLOCKS, BS, H, D)
        keys, values = LAYOUTS[layout].key_value(cache)
        rows = []
        for T, ids in zip(lengths, blocks):
            k, v = torch.randn(H, T, D), torch.randn(H, T, D)
            for t in range(T):
                keys[ids[t // BS], :, t % BS], values[ids[t // BS], :, t % BS] = k[:, t], v[:, t]
            rows.append((k, v))
        caches.append(cache)
        dense.append(rows)
    return caches, dense


@pytest.mark.parametrize("layout", ["cpu", "flash"])
@pytest.mark.parametrize("with_values", [True, False])
def test_gather_rows_stacks_layers_of_requests_of_any_length_padding_zero(layout, with_values):
    lengths, blocks = [11, 4, 7], [[7, 2, 12], [5], [0, 9]]
    caches, dense = _requests(layout, lengths, blocks, layers=2)
    S = max(lengths)
    live = torch.arange(S)[None] < torch.tensor(lengths)[:, None]
    keys, values = gather_rows(LAYOUTS[layout], caches, block_table(blocks), live, values=with_values)
    assert keys.shape == (2 * 3, H, S, D)
    assert (values is None) != with_values
    for layer in range(2):
        for r, T in enumerate(lengths):
            row = layer * 3 + r  # layer-major
            k, v = dense[layer][r]
            assert torch.equal(keys[row, :, :T], k) and not keys[row, :, T:].any()
            if with_values:
                assert torch.equal(values[row, :, :T], v) and not values[row, :, T:].any()


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_compact_rows_moves_each_requests_heads_into_their_first_slots(layout):
    lengths, blocks = [11, 7], [[7, 2, 12], [0, 9]]
    caches, dense = _requests(layout, lengths, blocks, layers=1)
    table = block_table(blocks)
    keep = torch.stack([torch.tensor([[10, 9, 3], [0, 1, 2], [4, 8, 5]]), torch.tensor([[6, 0, 1], [2, 2, 2], [5, 4, 3]])])
    compact_rows(LAYOUTS[layout], caches[0], table, keep)
    for r, ids in enumerate(blocks):
        gk, gv = gather(LAYOUTS[layout], caches[0], torch.tensor(ids), 3)
        k, v = dense[0][r]
        heads = torch.arange(H)[:, None]
        assert torch.equal(gk, k[heads, keep[r]]) and torch.equal(gv, v[heads, keep[r]])


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_cpu_layout_is_the_vec_kernels():
    """Pinned to vLLM's CPU ``vec``/``vec16`` kernels (csrc/cpu/cpu_attn_vec.hpp, ``reshape_and_cache``):
    per (block, head), keys column-major [D, block_size], then values row-major [block_size, D]."""
    cache = torch.zeros(NUM_BLOCKS, H, BS, 2 * D)
    flat = cache.view(NUM_BLOCKS, H, 2 * BS * D)
    block, head, t = 5, 2, 3
    for i in range(D):
        flat[block, head, i * BS + t] = 100 + i  # key
        flat[block, head, BS * D + t * D + i] = 200 + i  # value
    keys, values = LAYOUTS["cpu"].key_value(cache)
    assert keys[block, head, t].tolist() == [100 + i for i in range(D)]
    assert values[block, head, t].tolist() == [200 + i for i in range(D)]
    assert keys.abs().sum() == sum(100 + i for i in range(D))
