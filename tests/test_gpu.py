"""CUDA checks (`make test-gpu`, marker ``gpu``): skipped without a GPU, never part of `make test`.

They run on random-weight models at real shapes (``random:qwen2.5-1.5b``), because the GPU
machine has no model hub; greedy decoding of random weights is still deterministic, which is
all these exactness checks need.  The token-for-token checks (compiled vs eager, budget >=
length vs full) run in float32: a random model's next-token logits lie close together, and
in bf16 a change of kernel alone flips the argmax. On an H200 (2026-11-27, torch 2.11) the bf16
runs parted after 4-22 tokens where the kernels differ: the compiled step against eager (even
for ``full``), and methods that read attention weights (TOVA, H2O, LazyEviction: eager
attention) against ``full`` (SDPA); streaming and SnapKV matched. The compaction check stays in
bf16 and compares exactly, since a gather does no arithmetic.
"""

import pytest
import torch

from kvsieve import GenerateConfig, generate, make_policy
from kvsieve.cache import SieveCache
from kvsieve.schedule import indices_from_mask

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["Explain the water cycle step by step.", "List three prime numbers and say why each is prime."]


@pytest.fixture(scope="module")
def model_tok():
    from kvsieve.models import load_model

    return load_model("random:qwen2.5-1.5b", device="cuda", dtype="float32")  # TF32 stays off (torch's default)


def run(model_tok, policy, n=48, **kw):
    return generate(*model_tok, PROMPTS, policy, GenerateConfig(max_new_tokens=n, ignore_eos=True, **kw))


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming", "lazy", "snapkv"])
def test_budget_at_least_length_reproduces_full_on_cuda(model_tok, method):
    assert run(model_tok, make_policy(method, budget=4096)).token_ids == run(model_tok, None).token_ids


@pytest.mark.parametrize("method", ["full", "tova", "h2o", "streaming", "snapkv"])
def test_compiled_step_gives_the_eager_tokens(model_tok, method):
    """GenerateConfig(compile=True) on CUDA: torch.compile with mode="reduce-overhead" (CUDA graphs)."""
    # recent 8: SnapKV's default window (64) would not fit in budget 32
    policy = make_policy(method) if method == "full" else make_policy(method, budget=32, recent=8)
    eager = run(model_tok, policy, static_shapes=True)
    compiled = run(model_tok, policy, compile=True)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats[0].compiled_steps > 0


def test_compaction_equals_dense_gather_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, S, D = 2, 4, 40, 64
    cache = SieveCache(1)
    keys = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cache.begin_step(torch.arange(S, device="cuda").expand(B, S))
    cache.update(keys, values, 0)
    layer = cache.layers[0]
    keep = torch.rand(B, H, layer.capacity, device="cuda", generator=g) < 0.4
    keep[..., S:] = False
    K = int(keep.sum(-1).max())
    kept_idx, lengths = indices_from_mask(keep, K)
    layer.compact(kept_idx, lengths, capacity=K, max_len=K)
    for b in range(B):
        for h in range(H):
            kept = keep[b, h, :S].nonzero().flatten()
            n = kept.numel()
            assert torch.equal(layer.keys[b, h, :n], keys[b, h, kept])
            assert torch.equal(layer.values[b, h, :n], values[b, h, kept])
