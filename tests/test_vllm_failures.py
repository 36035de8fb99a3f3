"""No request can end the engine (issue 60): a request whose compaction fails, in the worker or
in the scheduler's plan, is finished alone with an error; the requests beside it run to the end
with the tokens they give when nothing fails, and the engine serves the next ones.

The failures are made by hand, as a bug or a bad file would make them: a request's kept state in
the worker is broken after its first compaction (its positions lose their layers), or the
scheduler's settings for a request are gone.  On the bundled SmolLM2-135M (fp32, eager, greedy),
TOVA at budget 64 with the serving defaults (compacted once per block of 32).  Needs the vLLM
environment; skipped where vLLM is not installed.  One engine start-up, about a minute on 2 cores.
"""

import gc

import pytest

from vllm_support import model_dir, require_vllm

require_vllm()

from kvsieve.vllm import engine_kwargs  # noqa: E402

PROMPTS = ["The history of the printing press begins", "In mathematics, a prime number is",
           "The river flows through the valley and"]
BLOCK, KV_BLOCKS, NEW_TOKENS = 32, 40, 160


@pytest.fixture(scope="module")
def llm():
    from vllm import LLM

    block_bytes = 30 * 3 * 64 * 2 * 4 * BLOCK  # fp32 SmolLM2: layers x kv heads x dims x (k, v) x 4 bytes
    llm = LLM(model=model_dir(), dtype="float32", enforce_eager=True, max_model_len=1024, block_size=BLOCK,
              kv_cache_memory_bytes=(KV_BLOCKS + 1) * block_bytes, seed=0, **engine_kwargs("tova", budget=64))
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _run(llm, prompts: list[str], fault=None, max_steps: int = 4 * NEW_TOKENS) -> dict:
    """Run ``prompts`` together as r0, r1, ..., stepping the engine; ``fault(llm, step)`` is called
    after every step.  Each request's tokens and finish reason, and whether every block is back."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    pool = _scheduler(llm).kv_cache_manager.block_pool
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens, reasons, steps = {}, {}, 0
    while engine.has_unfinished_requests() and steps < max_steps:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                reasons[out.request_id] = out.outputs[0].finish_reason
        steps += 1
        if fault is not None:
            fault(llm, steps)
    return {"tokens": [tokens.get(f"r{i}") for i in range(len(prompts))],
            "reasons": [reasons.get(f"r{i}") for i in range(len(prompts))],
            "all_free": pool.get_num_free_blocks() == pool.num_gpu_blocks - 1}


def _break_worker_state(req_id: str):
    """A fault that, once ``req_id`` has been compacted, leaves the worker's kept positions of it
    one layer deep: its next compaction fails while scoring (the batch, then it alone)."""
    done = []

    def fault(llm, step):
        def break_it(worker):
            states = worker.model_runner.sieve_requests
            state = next((states[r] for r in states if _is(r, req_id)), None)
            if state is None or state.pos is None:
                return False
            state.pos = state.pos[:1]
            return True

        if not done and llm.collective_rpc(break_it)[0]:
            done.append(step)
    return fault


def _lose_scheduler_settings(req_id: str, after_step: int):
    """A fault that, after ``after_step``, makes the scheduler's settings of ``req_id`` unreadable:
    planning its next compaction fails."""
    def fault(llm, step):
        if step == after_step:
            scheduler = _scheduler(llm)
            scheduler.sieve_requests[next(r for r in scheduler.requests if _is(r, req_id))] = ({}, None)
    return fault


def _is(internal_id: str, req_id: str) -> bool:
    """Whether the engine's id of a request is ``req_id``'s (vLLM adds a suffix of its own)."""
    return internal_id == req_id or internal_id.startswith(req_id + "-")


def test_a_request_whose_compaction_fails_ends_alone_and_the_engine_goes_on(llm):
    clean = _run(llm, PROMPTS)
    assert clean["reasons"] == ["length"] * 3 and clean["all_free"]
    scheduler = _scheduler(llm)
    failed_before = scheduler.sieve_stats["failed"]

    broken = _run(llm, PROMPTS, fault=_break_worker_state("r1"))
    assert broken["reasons"] == ["length", "error", "length"] and broken["all_free"]
    assert broken["tokens"][0] == clean["tokens"][0] and broken["tokens"][2] == clean["tokens"][2]
    assert len(broken["tokens"][1]) < NEW_TOKENS  # ended at its second compaction
    assert broken["tokens"][1] == clean["tokens"][1][:len(broken["tokens"][1])]
    assert scheduler.sieve_stats["failed"] == failed_before + 1

    after = _run(llm, PROMPTS[:2])  # the engine serves on
    assert after["reasons"] == ["length", "length"] and after["tokens"] == clean["tokens"][:2]
    assert after["all_free"] and not scheduler.sieve_held


def test_a_request_whose_compaction_cannot_be_planned_ends_alone(llm):
    clean = _run(llm, PROMPTS)
    scheduler = _scheduler(llm)
    failed_before = scheduler.sieve_stats["failed"]
    lost = _run(llm, PROMPTS, fault=_lose_scheduler_settings("r2", after_step=40))
    assert lost["reasons"] == ["length", "length", "error"] and lost["all_free"]
    assert lost["tokens"][:2] == clean["tokens"][:2]
    assert 40 <= len(lost["tokens"][2]) < NEW_TOKENS
    assert scheduler.sieve_stats["failed"] == failed_before + 1
    assert not scheduler.sieve_requests  # (offsets of finished requests go at the next schedule)
    assert not any(req_id in scheduler.requests for req_id in scheduler.sieve_offsets)
