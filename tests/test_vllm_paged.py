"""Paged compaction (kvsieve.vllm.paged) against a dense reference, in vLLM's CPU layout and the
FlashAttention layout: plain torch, no vLLM needed."""

import pytest
import torch

from kvsieve.vllm.paged import LAYOUTS, blocks_for, compact_, gather

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
