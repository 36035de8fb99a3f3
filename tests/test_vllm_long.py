"""Requests longer than the KV pool (issue 59 item 1), in a real vLLM engine on the bundled
SmolLM2-135M: with a method and a budget, ``max_model_len`` may exceed the pool (kvsieve's KV cache
spec answers vLLM's start-up check with the most a request holds, ``bounds.held_tokens``), requests
are admitted only while the pool holds what every admitted one may hold, so none is preempted,
and each finishes whole with every block back.  Plain vLLM refuses the same pool at start-up.

    PYTHONPATH=src .vllm-env/bin/python -m pytest -q tests/test_vllm_long.py
"""

import gc

import pytest

from vllm_support import model_dir, require_vllm, run_to_end, scheduler_of

require_vllm()

from kvsieve.vllm import engine_kwargs  # noqa: E402

BLOCK, BUDGET, NEW = 32, 64, 300
PROMPTS = ["The history of the printing press begins", "In mathematics, a prime number is",
           "Once upon a time, in a small village by the sea,"]
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * BLOCK  # fp32 SmolLM2: 30 layers x 3 kv heads x 64 dims x (k, v)


def _engine(kv_blocks: int, max_model_len: int, method: str, chunk: int | None = None, **settings):
    from vllm import LLM

    extra = engine_kwargs(method, BUDGET if method != "full" else None, **settings)
    if chunk:
        extra["max_num_batched_tokens"] = chunk  # vLLM's prefill chunk
    return LLM(model=model_dir(), dtype="float32", enforce_eager=True, max_model_len=max_model_len, block_size=BLOCK,
               kv_cache_memory_bytes=(kv_blocks + 1) * BLOCK_BYTES, seed=0, max_num_seqs=4, **extra)


def _close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _run(llm, prompts, new=NEW):
    """``run_to_end`` with the peak of running requests and the preemptions counted."""
    from vllm import SamplingParams

    scheduler = scheduler_of(llm)
    seen = {"running": 0, "preemptions": 0}

    def count(_step):
        seen["running"] = max(seen["running"], len(scheduler.running))
        seen["preemptions"] = max(seen["preemptions"], sum(r.num_preemptions for r in scheduler.requests.values()))

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    run = run_to_end(llm, [(p, params) for p in prompts], max_steps=5000, after_step=count)
    return {**run, **seen, "reserved": dict(scheduler.kv_cache_manager.reserved)}


@pytest.mark.parametrize("method", ["streaming", "h2o"])
def test_requests_longer_than_the_pool_finish_whole_without_preemption(method):
    """An 8-block pool (256 tokens) and requests of about 310 tokens at budget 64: each may hold 3
    blocks (64 + a block's growth), so two run at once and the third waits for a slot; none is
    preempted; the tokens are those of the same method in a pool that holds every request whole."""
    llm = _engine(8, 1024, method)
    long = _run(llm, PROMPTS)
    _close(llm)
    llm = _engine(40, 1024, method)
    roomy = _run(llm, PROMPTS)
    _close(llm)
    assert long["reasons"] == ["length"] * 3 and [len(t) for t in long["tokens"]] == [NEW] * 3
    assert long["preemptions"] == 0 and long["running"] == 2
    assert long["all_free"] and not long["reserved"]
    assert max(long["used"]) <= 6  # two requests of 3 blocks
    assert long["tokens"] == roomy["tokens"]


def test_a_prompt_the_pool_cannot_hold_is_refused_alone():
    """A prompt of more tokens than the pool is finished with an error before it is scheduled (it
    would wait for ever); the other request runs on."""
    from vllm import SamplingParams

    llm = _engine(4, 1024, "streaming")
    long_prompt = " ".join(["word"] * 200)  # about 200 tokens > the pool's 128
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    run = run_to_end(llm, [(long_prompt, params), (PROMPTS[0], params)], max_steps=500)
    refused = scheduler_of(llm).sieve_stats["refused"]
    _close(llm)
    assert run["reasons"] == ["error", "length"] and len(run["tokens"][1]) == 40
    assert refused == 1 and run["all_free"]


LONG_PROMPT = " ".join(f"Item {i} costs {i * 7 % 13 + 1} dollars." for i in range(110))  # about 1,100 tokens


@pytest.mark.parametrize("method", ["snapkv", "h2o", "tova"])
def test_a_prompt_longer_than_the_pool_is_compressed_between_prefill_chunks(method):
    """A 1,100-token prompt, a pool of 16 blocks (512 tokens), prefill chunks of 256: before each
    chunk the prompt read so far is compressed to the budget, so the request holds at most the
    budget and one chunk (64 + 256 tokens: 10 blocks), and it finishes whole."""
    from vllm import SamplingParams

    llm = _engine(16, 2048, method, chunk=256)
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    peak = {"blocks": 0}

    def count(_step):
        peak["blocks"] = max(peak["blocks"], pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())

    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    run = run_to_end(llm, [(LONG_PROMPT, params), (PROMPTS[0], params)], max_steps=2000, after_step=count)
    stats = dict(scheduler.sieve_stats)
    _close(llm)
    assert run["reasons"] == ["length", "length"] and [len(t) for t in run["tokens"]] == [80, 80]
    assert stats["compactions"] >= 4 and stats["refused"] == 0  # 3 chunk boundaries, then decode
    assert peak["blocks"] <= 10 + 3  # the long request's 10, the short one's 3 (64 + a block's growth)
    assert run["all_free"]


def test_a_kept_prompt_longer_than_the_pool_is_refused():
    """A method that keeps the prompt cannot compress it between chunks: refused alone, in one line."""
    from vllm import SamplingParams

    llm = _engine(16, 2048, "streaming", chunk=256, protect_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    run = run_to_end(llm, [(LONG_PROMPT, params), (PROMPTS[0], params)], max_steps=500)
    _close(llm)
    assert run["reasons"] == ["error", "length"] and run["all_free"]


def test_plain_vllm_refuses_the_same_pool():
    """Without eviction (method full: vLLM's own KV cache spec), vLLM's start-up check refuses a
    pool smaller than one max_model_len request, as it does for plain vLLM."""
    with pytest.raises(Exception, match="max seq len|KV cache"):
        _engine(8, 1024, "full")
