"""The KV layout kvsieve reads (kvsieve.vllm.paged.CpuLayout) against vLLM's own CPU cache write
(``ops.cpu_attn_reshape_and_cache``): a kernel that packs its blocks differently fails here.
Needs the vLLM environment (docs/vllm-design.md); skipped elsewhere.  Under a second."""

import pytest
import torch

pytest.importorskip("vllm")

from kvsieve.vllm.paged import CpuLayout, gather  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_what_vllms_cpu_kernel_wrote(dtype):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, heads, block, dim, tokens = 8, 3, 32, 64, 45
    isa = _get_attn_isa(dtype, block, dim)
    try:
        layout = CpuLayout.for_isa(isa)
    except ValueError as err:  # an AMX or ARM machine: refused, and said so
        pytest.skip(str(err))
    cache = torch.zeros(num_blocks, heads, block, 2 * dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block, dim).chunk(2, dim=2)  # as cpu_attn.py
    key, value = torch.randn(tokens, heads, dim, dtype=dtype), torch.randn(tokens, heads, dim, dtype=dtype)
    block_ids = torch.tensor([5, 2])
    t = torch.arange(tokens)
    slots = block_ids[t // block] * block + t % block
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    keys, values = gather(layout, cache, block_ids, tokens)
    assert torch.equal(keys, key.transpose(0, 1)) and torch.equal(values, value.transpose(0, 1))
