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


def test_query_rings_hand_back_each_requests_last_queries():
    """``QueryRecorder``: steps of several requests' query rows (prefill chunks longer than the ring,
    single decode rows, a request finishing and its ring reused), then ``rows`` of several
    requests at once equals each request's last n queries kept here in plain lists."""
    from kvsieve.vllm.attention import QueryRecorder

    window, heads, dim = 4, 2, 3
    recorder = QueryRecorder(["a", "b"], max_slots=3, window=window, num_heads=heads, head_size=dim,
                             dtype=torch.float32)
    seen: dict[str, list[torch.Tensor]] = {}  # request -> every query row recorded, layer "b"
    g = torch.Generator().manual_seed(0)
    steps = [{"x": 6, "y": 2}, {"x": 1, "y": 1}, {"x": 1, "z": 3}, {"y": 1, "z": 1}, {"z": 1, "w": 5}]
    for step in steps:
        if "w" in step:  # x finished: its ring is free for w
            recorder.forget("x")
            seen.pop("x")
        ids, counts = list(step), list(step.values())
        ends = torch.tensor(counts).cumsum(0).tolist()
        recorder.plan(ids, [e - n for e, n in zip(ends, counts)], ends)
        rows = torch.randn(ends[-1], heads, dim, generator=g)
        recorder.record("a", torch.zeros_like(rows))
        recorder.record("b", rows)
        for req, start, end in zip(ids, [e - n for e, n in zip(ends, counts)], ends):
            seen.setdefault(req, []).extend(rows[start:end])
    for req in seen:
        assert recorder.held(req) == min(len(seen[req]), window)
    ids = ["y", "z", "w"]
    for n in (1, 2, 3):
        got = recorder.rows(1, ids, n)  # [R, H, n, D]
        assert torch.equal(got, torch.stack([torch.stack(seen[r][-n:], dim=1) for r in ids]))
    assert not recorder.rows(0, ids, 2).any()  # layer "a" got zeros
