"""Per-request eviction settings inside vLLM (issue 49): a request's ``kvsieve_*`` keys of
``SamplingParams.extra_args`` set its own budget, interval, sinks and recent window in a server
started with others.  On the bundled SmolLM2-135M (fp32, eager, greedy), KeyDiff at interval 16.

Every expected value comes from a server started with the request's settings server-wide, never
from the per-request path: a request that sets its own budget must give that server's tokens and
hold its blocks step by step.

Needs the vLLM environment (``/work/vllm-env``, docs/vllm-design.md); skipped where vLLM is not
installed:

    PYTHONPATH=src /work/vllm-env/bin/python -m pytest -q tests/test_vllm_per_request.py

Three engine start-ups (two server-wide references, one server under test), a few minutes on 2 cores.
"""

import gc
import logging

import pytest

from vllm_support import model_dir, require_vllm, run_to_end, scheduler_of

require_vllm()

from kvsieve.vllm import engine_kwargs  # noqa: E402

PROMPTS = ["The history of the printing press begins", "In mathematics, a prime number is"]
BLOCK, KV_BLOCKS = 32, 40
METHOD, INTERVAL = "keydiff", 16
SERVER = {"budget": 128}  # the server under test
OWN = {"budget": 32}  # request 0's own settings
OTHER = {"budget": 64, "recent": 16}  # request 1's own settings
NEW_TOKENS = 80


def _xargs(settings: dict) -> dict:
    return {f"kvsieve_{name}": value for name, value in settings.items()}


def _engine(**settings):
    """An in-process LLM serving KeyDiff at interval 16 with ``settings`` server-wide."""
    from vllm import LLM

    block_bytes = 30 * 3 * 64 * 2 * 4 * BLOCK  # fp32 SmolLM2: layers x kv heads x dims x (k, v) x 4 bytes
    return LLM(model=model_dir(), dtype="float32", enforce_eager=True, max_model_len=1024, block_size=BLOCK,
               kv_cache_memory_bytes=(KV_BLOCKS + 1) * block_bytes, seed=0,
               **engine_kwargs(METHOD, interval=INTERVAL, **settings))


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _params(extra_args: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, extra_args=extra_args)


def _run(llm, requests: list[tuple[str, dict | None]], max_steps: int = 10 * NEW_TOKENS) -> dict:
    """Run ``requests`` (prompt, extra_args) together to the end (``run_to_end``)."""
    return run_to_end(llm, [(prompt, _params(extra_args)) for prompt, extra_args in requests], max_steps)


@pytest.fixture(scope="module")
def server_wide():
    """The references: request 0 alone and both requests together at ``OWN`` server-wide, and both
    together at ``OTHER`` server-wide."""
    llm = _engine(**OWN)
    alone = _run(llm, [(PROMPTS[0], None)])
    own_pair = _run(llm, [(PROMPTS[0], None), (PROMPTS[1], None)])
    _close(llm)
    llm = _engine(**OTHER)
    other_pair = _run(llm, [(PROMPTS[0], None), (PROMPTS[1], None)])
    _close(llm)
    return {"alone": alone, "own_pair": own_pair, "other_pair": other_pair}


@pytest.fixture(scope="module")
def llm(server_wide):
    """The server under test, started once the references are done: two in-process engines must
    not overlap (closing one tears down the process's distributed state the other uses)."""
    llm = _engine(**SERVER)
    yield llm
    _close(llm)


def test_a_requests_own_budget_gives_that_budgets_tokens_and_blocks(llm, server_wide):
    """A request with its own budget in a server of another: the tokens and, step by step, the
    blocks of a server started with that budget; the server's own budget would hold more."""
    reference = server_wide["alone"]
    own = _run(llm, [(PROMPTS[0], _xargs(OWN))])
    servers = _run(llm, [(PROMPTS[0], None)])
    assert own["reasons"] == ["length"] and own["all_free"]
    assert own["tokens"] == reference["tokens"]
    assert own["used"] == reference["used"]
    assert max(servers["used"]) > max(own["used"])  # the server's budget holds more: the test can tell


def test_two_requests_with_different_budgets_in_one_batch(llm, server_wide):
    """Two requests of different settings (budget; budget and recent window) run together, each
    token for token what a server started with its settings gives for it in the same batch."""
    scheduler = scheduler_of(llm)
    before = scheduler.sieve_stats["compactions"]
    pair = _run(llm, [(PROMPTS[0], _xargs(OWN)), (PROMPTS[1], _xargs(OTHER))])
    assert pair["reasons"] == ["length", "length"] and pair["all_free"]
    assert pair["tokens"][0] == server_wide["own_pair"]["tokens"][0]
    assert pair["tokens"][1] == server_wide["other_pair"]["tokens"][1]
    assert scheduler.sieve_stats["compactions"] > before
    assert not scheduler.sieve_requests  # dropped with the requests


@pytest.mark.parametrize("extra_args, message", [
    ({"kvsieve_budgett": 32}, "kvsieve: unknown per-request setting 'kvsieve_budgett' (did you mean kvsieve_budget?); "
                              "known: kvsieve_budget, kvsieve_interval, kvsieve_sinks, kvsieve_recent"),
    ({"kvsieve_budget": "32"}, "kvsieve: kvsieve_budget must be an integer, got '32' (str)"),
    ({"kvsieve_interval": 0}, "kvsieve: kvsieve_interval must be >= 1, got 0"),
    ({"kvsieve_sinks": 1.5}, "kvsieve: kvsieve_sinks must be an integer, got 1.5 (float)"),
])
def test_bad_keys_and_values_are_refused_before_queueing(llm, extra_args, message):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as refused:
        llm.generate(PROMPTS[0], _params(extra_args), use_tqdm=False)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not scheduler_of(llm).requests and not llm.llm_engine.has_unfinished_requests()


def test_an_unfittable_budget_finishes_that_request_with_an_error(llm, caplog):
    """Settings that do not fit the server's method (a budget below the protected tokens, a recent
    window above the budget) pass the key and type check; the scheduler finishes that request with
    an error before it is scheduled, alone or among others, which run to the end; every block
    comes back."""
    from kvsieve.vllm import scheduler as scheduler_module

    scheduler = scheduler_of(llm)
    refused = scheduler.sieve_stats["refused"]
    # kvsieve's lines go to vLLM's logger (which does not propagate to the root caplog watches)
    scheduler_module.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            alone = _run(llm, [(PROMPTS[0], {"kvsieve_budget": 8, "kvsieve_sinks": 16})], max_steps=5)
    finally:
        scheduler_module.logger.removeHandler(caplog.handler)
    assert alone["reasons"] == ["error"] and alone["tokens"] == [[]] and alone["steps"] == 1
    assert alone["all_free"] and alone["used"] == [0]
    assert "raise kvsieve_budget to at least 16" in caplog.text
    mixed = _run(llm, [(PROMPTS[0], None), (PROMPTS[1], {"kvsieve_recent": 200}), (PROMPTS[1], _xargs(OWN))])
    assert mixed["reasons"] == ["length", "error", "length"]
    assert [len(t) for t in mixed["tokens"]] == [NEW_TOKENS, 0, NEW_TOKENS]
    assert mixed["all_free"] and not scheduler.sieve_held and not scheduler.sieve_requests
    assert scheduler.sieve_stats["refused"] == refused + 2
