"""Shared fixtures: the bundled SmolLM2-135M, loaded once per test session."""

import os

import pytest
import torch

WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))


@pytest.fixture(autouse=True)
def _one_thread_per_worker():
    """`make test` runs two workers on two cores: one torch thread each, set before every test so
    that a test which sets its own count (a benchmark's ``--threads``) does not oversubscribe the
    cores for the tests after it.  Without it the workers' OpenMP pools spin against each other
    and the suite runs slower than one process (measured beside the accuracy grid: 4 threads on 2
    cores had run a third of the suite after 7 minutes)."""
    if WORKER:
        torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def smollm():
    from kvsieve.models import ModelNotInstalledError, load_model

    torch.manual_seed(0)
    try:
        return load_model("smollm2-135m", device="cpu", dtype="float32")
    except ModelNotInstalledError as err:  # `make test` installs it; a bare pytest may not have
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def full_greedy(smollm):
    """``full_greedy(prompts, n)``: the bundled model's full-cache greedy output, decoded once per
    session for each (prompts, new tokens): the reference of the exactness tests, which would
    otherwise each decode it again."""
    from kvsieve import GenerateConfig, generate

    done = {}

    def run(prompts, n: int):
        key = (tuple(prompts), n)
        if key not in done:
            done[key] = generate(*smollm, list(prompts), None, GenerateConfig(max_new_tokens=n))
        return done[key]

    return run
