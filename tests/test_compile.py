"""The compiled decode step (``GenerateConfig(compile=True)``, ``kvsieve.session``) on the bundled
SmolLM2-135M.

``torch.compile(fullgraph=True)`` refuses any ``.item()``, ``.tolist()`` or data-dependent
Python branch, so a step that compiles as one graph is a step free of host syncs, the same
thing a CUDA graph needs.  The default suite traces with Dynamo's ``eager`` backend (the same
graph capture, guards and recompiles as Inductor, without minutes of C++ code generation per
policy on this CPU); the ``slow`` tests run Inductor itself.
"""

import warnings

import pytest
import torch

from kvsieve import GenerateConfig, generate, make_policy
from kvsieve.session import compile_backend

EARLY = ["Count from 1 to 100, separated by commas.", "Say hello."]  # the second row ends at EOS first
BUDGET = 32

# The policies; intervals small enough for several compression cycles in 48 tokens.
POLICIES = {
    "full": {},
    "tova": {},
    "h2o": {},
    "streaming": {},
    "snapkv": {"window": 8, "interval": 8},
    "lazy": {"window": 8},
    "ams:tova": {"interval": 8, "recent": 8},
    "caote:tova": {},
    "expected": {"interval": 8},
}


def policy_for(name):
    return None if name == "full" else make_policy(name, budget=BUDGET, **POLICIES[name])


def run(smollm, prompts, name, compile, n=48, **kw):
    model, tok = smollm
    return generate(model, tok, prompts, policy_for(name), GenerateConfig(max_new_tokens=n, compile=compile, **kw))


# One every-step policy in the default suite (an interval one, snapkv, was too: moved to keep the
# suite under 10 minutes); the rest run with `make test-slow` (each costs 20-60 s of tracing on 2 cores).
DEFAULT_SUITE = ("tova",)


@pytest.mark.parametrize("name", [n if n in DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in POLICIES])
def test_step_compiles_as_one_graph_equals_eager_and_never_recompiles(smollm, name):
    """fullgraph=True traces every decode step of the run (a host sync or graph break would
    raise), and the compiled run's greedy tokens equal the eager run's, through compression
    cycles and a row finishing early (the batch then shrinks to its bucket of one row).  Once
    warm, another run with prompts of other lengths (in the same capacity bucket for ``full``),
    several compression cycles and rows leaving compiles nothing: Dynamo is told to fail on any
    recompile."""
    eager = run(smollm, EARLY, name, compile=False)
    with compile_backend("eager"):
        compiled = run(smollm, EARLY, name, compile=True)  # also the warm-up: batch buckets 2 and 1
        other = ["Count from 1 to 100, separated by commas please.", "Say hi."]
        with torch.compiler.set_stance("fail_on_recompile"):
            again = run(smollm, other, name, compile=True)
    assert compiled.token_ids == eager.token_ids
    assert [s.finish_reason for s in compiled.stats] == [s.finish_reason for s in eager.stats]
    if name in ("full", "tova", "snapkv"):  # these keep the short answer: its row leaves the batch early
        assert [s.finish_reason for s in compiled.stats] == ["length", "eos"]
    assert compiled.stats[0].compiled_steps > 0 and again.stats[0].compiled_steps > 0
    if name != "full":
        assert compiled.stats[0].compression_events >= 3 and again.stats[0].compression_events >= 3
        assert [s.compression_events for s in compiled.stats] == [s.compression_events for s in eager.stats]
        assert [s.peak_kv_tokens for s in compiled.stats] == [s.peak_kv_tokens for s in eager.stats]


def test_host_hook_policies_say_so_and_run_eagerly(smollm):
    """SkipKV tracks sentences with a per-token host hook: compile=True warns once and decodes
    eagerly, with the eager tokens."""
    model, tok = smollm
    policy = make_policy("skipkv", budget=64)
    eager = generate(model, tok, EARLY[:1], policy, GenerateConfig(max_new_tokens=12))
    import kvsieve.session as session_module

    session_module._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="host hooks"):
        compiled = generate(model, tok, EARLY[:1], policy, GenerateConfig(max_new_tokens=12, compile=True))
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats[0].compiled_steps == 0


def test_random_says_its_in_step_scores_cannot_compile_and_runs_eagerly_with_the_eager_tokens(smollm):
    """random draws from a torch.Generator, which Dynamo cannot trace: evicting every step
    (its default), compile=True warns once and decodes eagerly, where it used to raise inside the
    traced step; at an interval its scores are drawn in the eager compression, so the decode
    step still compiles.  Both give the eager run's tokens (the generator restarts per call)."""
    import kvsieve.session as session_module

    model, tok = smollm
    for interval, compiles in ((1, False), (4, True)):
        policy = make_policy("random", budget=BUDGET, interval=interval)
        eager = generate(model, tok, EARLY, policy, GenerateConfig(max_new_tokens=40))
        session_module._WARNED.clear()
        with compile_backend("eager"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = generate(model, tok, EARLY, policy, GenerateConfig(max_new_tokens=40, compile=True))
        said = [str(w.message) for w in caught if "cannot be traced" in str(w.message)]
        assert compiled.token_ids == eager.token_ids
        assert compiled.stats[0].compression_events >= 3
        assert (compiled.stats[0].compiled_steps > 0) == compiles
        assert len(said) == (0 if compiles else 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POLICIES))
def test_inductor_step_equals_eager(smollm, name):
    """The real backend (Inductor's generated C++ kernels): same greedy tokens as eager."""
    eager = run(smollm, EARLY, name, compile=False, n=32)
    compiled = run(smollm, EARLY, name, compile=True, n=32)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats[0].compiled_steps > 0
