"""What the vLLM tests share (tests/test_vllm_*.py): the skip where vLLM is missing or not a
tested version, the in-process engine core, the bundled model's directory and the scripts they run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def require_vllm() -> None:
    """Skip the calling module where vLLM is not installed or is not a tested version
    (``check_vllm``), and run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    set before vLLM reads its environment) so a test can step it and read its scheduler."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (make vllm-env builds its environment)", allow_module_level=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvsieve.vllm import UnsupportedVLLM, check_vllm

    try:
        check_vllm()
    except UnsupportedVLLM as err:  # pragma: no cover
        pytest.skip(str(err), allow_module_level=True)


def model_dir() -> str:
    """The bundled smollm2-135m's converted directory, or a skip naming how to install it."""
    from kvsieve.models import ModelNotInstalledError, ensure_bundled

    try:
        return str(ensure_bundled("smollm2-135m"))
    except ModelNotInstalledError as err:
        pytest.skip(str(err))


def load_script(name: str):
    """``scripts/NAME.py`` as a module (registered under NAME, as its sibling imports expect)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def scheduler_of(llm):
    """The kvsieve scheduler of an in-process ``vllm.LLM`` (``require_vllm``'s engine core)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def run_to_end(llm, requests: list, max_steps: int, after_step=None) -> dict:
    """Add ``requests`` ((prompt, SamplingParams) each, as r0, r1, ...) and step the engine until
    they finish or ``max_steps`` have run; ``after_step(step)`` is called after every step.  Each
    request's tokens and finish reason, the blocks in use after every step, the steps taken, and
    whether every block is back at the end."""
    engine = llm.llm_engine
    pool = scheduler_of(llm).kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # one block is vLLM's null block
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    tokens, reasons, used, steps = {}, {}, [], 0
    while engine.has_unfinished_requests() and steps < max_steps:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                reasons[out.request_id] = out.outputs[0].finish_reason
        steps += 1
        used.append(total - pool.get_num_free_blocks())
        if after_step is not None:
            after_step(steps)
    return {"tokens": [tokens.get(f"r{i}") for i in range(len(requests))],
            "reasons": [reasons.get(f"r{i}") for i in range(len(requests))],
            "used": used, "steps": steps, "all_free": pool.get_num_free_blocks() == total}


def run_script(name: str, tmp_path: Path, *args: str) -> dict:
    """``scripts/NAME.py ARGS --out FILE`` in a process of its own, with this checkout's src/: the
    JSON it wrote (a failed run fails the test with the end of its stderr)."""
    out = tmp_path / f"{name}.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args, "--out", str(out)],
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                         timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())
