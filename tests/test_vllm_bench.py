"""scripts/vllm_bench.py (issue 49's benchmark) at a tiny size: in a pool plain vLLM cannot hold
at once, kvsieve at a small budget runs every request concurrently with no preemption, while plain
vLLM preempts or queues them, as read from the engine's scheduler.

Needs the vLLM environment; skipped elsewhere:

    PYTHONPATH=src /work/vllm-env/bin/python -m pytest -q tests/test_vllm_bench.py

Two engine start-ups make most of its time: 3 min 8 s at a load average of 5-9 on 2 cores, 6 min
26 s at 17.
"""

import pytest

from vllm_support import load_script, model_dir, require_vllm

require_vllm()

# 4 requests of ~10 prompt tokens + 96 new ones need 4 blocks of 32 each at their end: 16 blocks for
# plain vLLM.  At budget 32, interval 8, a request holds at most ceil(40 / 32) + 1 = 3: 12 for all 4.
REQUESTS, NEW, BLOCKS, BLOCK, BUDGET, INTERVAL = 4, 96, 12, 32, 32, 8


@pytest.fixture(scope="module")
def bench():
    model_dir()  # skips where the bundled model is not installed
    return load_script("vllm_bench")


def test_largest_batch_counts_only_requests_never_preempted_later(bench):
    import vllm_capacity

    running = [("a", "b", "c"), ("a", "b", "c"), ("a", "c"), ("a", "b", "c")]
    # b preempted at step 2 and back at step 3; c never; a preempted at step 3 (after which it is waiting)
    assert vllm_capacity.largest_batch_without_preemption(running, {"b": 2}) == 3  # step 3: a, b, c
    assert vllm_capacity.largest_batch_without_preemption(running[:3], {"b": 2, "a": 2}) == 2  # a, c at step 2
    assert vllm_capacity.largest_batch_without_preemption(running, {"a": 3, "b": 3, "c": 3}) == 3  # all at step 3
    assert vllm_capacity.largest_batch_without_preemption([], {}) == 0


def test_kvsieve_runs_every_request_at_once_where_plain_preempts_or_queues(bench):
    sizes = dict(requests=REQUESTS, new_tokens=NEW, kv_blocks=BLOCKS, block_size=BLOCK, interval=INTERVAL)
    plain = bench.run_one("plain", None, **sizes)
    sieve = bench.run_one("streaming", BUDGET, **sizes)
    for run in (plain, sieve):
        assert run["tokens"] == REQUESTS * NEW and run["short_requests"] == 0, run
        assert run["all_blocks_back"], run
    assert plain["preemptions"] > 0 or plain["steps_with_waiting"] > 0, plain
    assert plain["largest_batch_no_preemption"] < REQUESTS, plain
    assert plain["peak_blocks"] == BLOCKS, plain  # plain fills the pool
    assert sieve["preemptions"] == 0 and sieve["steps_with_waiting"] == 0, sieve
    assert sieve["peak_running"] == sieve["largest_batch_no_preemption"] == REQUESTS, sieve
    assert sieve["peak_blocks"] <= BLOCKS, sieve
    ratio = bench.ratios([plain, sieve, plain])[0]
    assert ratio["largest_batch_no_preemption_x_plain_first"] == round(REQUESTS / plain["largest_batch_no_preemption"], 2)
