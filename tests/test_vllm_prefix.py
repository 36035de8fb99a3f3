"""Prefix caching with eviction (issue 59 item 2), in a real vLLM engine on the bundled
SmolLM2-135M: for a method that keeps the prompt (``protect_prompt``), vLLM's prefix caching stays
on, requests with the same 1,000-token prefix read the first one's cached blocks while it is being
compacted, their tokens are those of the same method with prefix caching off, and every block
comes back.  (The refusals for methods whose prompt competes: tests/test_cli_serve.py and
tests/test_vllm_plan.py.)

    PYTHONPATH=src .vllm-env/bin/python -m pytest -q tests/test_vllm_prefix.py
"""

import gc

import pytest

from vllm_support import model_dir, require_vllm, scheduler_of

require_vllm()

from kvsieve.vllm import engine_kwargs  # noqa: E402

BLOCK, BUDGET, NEW = 32, 64, 160
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * BLOCK  # fp32 SmolLM2: 30 layers x 3 kv heads x 64 dims x (k, v)
PREFIX = "Price list. " + " ".join(f"Item {i} costs {i * 7 % 13 + 1} dollars." for i in range(125))
QUESTIONS = [" Which item costs the most?", " Which item costs the least?", " How much do items 3 and 4 cost?"]


def _engine(prefix_caching: bool, method: str = "tova", **settings):
    from vllm import LLM

    return LLM(model=model_dir(), dtype="float32", enforce_eager=True, max_model_len=2048, block_size=BLOCK,
               kv_cache_memory_bytes=161 * BLOCK_BYTES, seed=0, max_num_seqs=4, disable_log_stats=False,
               **engine_kwargs(method, BUDGET, prefix_caching=prefix_caching, **settings))


def _staggered(llm) -> dict:
    """Request q0, then q1 once q0 has been compacted, then q2 later (each shares the prefix):
    each request's tokens and cached prompt tokens, the compactions, and whether every block is
    free at the end."""
    from vllm import SamplingParams

    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    starts = {0: 0, 1: 90, 2: 150}  # steps: q0's first compaction comes after 65 decode steps
    hits_before = _prefix_cache_hits(llm)
    tokens, cached, step = {}, {}, 0
    while step == 0 or engine.has_unfinished_requests() or len(tokens) < len(starts):
        for i, at in starts.items():
            if at == step:
                engine.add_request(f"q{i}", PREFIX + QUESTIONS[i], params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens
        step += 1
    result = {"tokens": [tokens[f"q{i}"] for i in starts], "cached": [cached[f"q{i}"] for i in starts],
              "compactions": scheduler.sieve_stats["compactions"], "hits": _prefix_cache_hits(llm) - hits_before,
              "all_free": pool.get_num_free_blocks() == pool.num_gpu_blocks - 1}
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    return result


@pytest.mark.parametrize("method", ["tova", "streaming"])
def test_a_kept_prompt_is_shared_while_its_owner_is_compacted(method):
    on = _staggered(_engine(True, method, protect_prompt=True))
    off = _staggered(_engine(False, method, protect_prompt=True))
    prompt_blocks = len(model_tokens(PREFIX)) // BLOCK
    assert on["cached"][0] == 0 and min(on["cached"][1:]) >= (prompt_blocks - 1) * BLOCK  # the prefix hit
    assert off["cached"] == [0, 0, 0]
    assert on["hits"] == sum(on["cached"]) and off["hits"] == 0  # vLLM's own counter, vllm:prefix_cache_hits
    assert on["compactions"] > 3 and on["compactions"] == off["compactions"]
    assert on["tokens"] == off["tokens"]
    assert on["all_free"] and off["all_free"]


def test_a_method_whose_prompt_competes_is_refused_with_prefix_caching():
    with pytest.raises(Exception, match="lets the prompt compete with the output"):
        _engine(True, "tova")


def _prefix_cache_hits(llm) -> float:
    """vLLM's own prefix-cache hit counter (``vllm:prefix_cache_hits``, in tokens), as /metrics shows it."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def model_tokens(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())(text)["input_ids"]
