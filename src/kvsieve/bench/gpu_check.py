"""The GPU check in one command (``make gpu-check``): its tests and benchmarks on one CUDA GPU.

In order, on ``--device`` (default ``cuda``):

1. the ``gpu`` tests (``tests/test_gpu.py``, run by pytest in a child process);
2. the compiled-step benchmark (``bench compiled``) on ``--model`` (default ``random:qwen2.5-7b``,
   bf16) at batch 64: transformers' eager ``generate``, its static cache compiled, and
   kvsieve's ``full`` and ``tova@256``, each eager and compiled (CUDA graphs);
3. the long-generation benchmark (``bench long``) at budget 1024, batch 32: ``full`` vs ``tova``
   to the longest of 1024, 2048, 4096 and 8192 tokens that the time left allows, compiled or
   eager, whichever goes further by step 2's speed and compile time of ``full`` (``long_plan``);

then one summary table of ratios. Each benchmark writes its JSON and PNG to ``--out-dir``
(``benchmarks/results/gpu/``), beside ``gpu_check.json`` (the summary, step times, machine).
``gpu_check.json`` is rewritten after every step, so a run stopped at its time limit keeps the
steps it finished; a benchmark step that raises is one ``failed: ...`` row of the summary, and
the check goes on (exit status 1).

It imports torch, transformers (and what they pull in) and the standard library only, so it
reads its options with argparse, not through the typer CLI (``kvsieve``): that needs typer and
rich, and ``make gpu-vendor`` puts neither on the path. It runs the benchmarks through their
Python functions and settings (``bench.settings``), not their commands.
pytest (step 1) and matplotlib (the PNGs) are used when present; each step says in one line
when one is missing (``make gpu-vendor`` puts pytest's pure-Python wheels in ``.gpu-vendor/``,
which ``make gpu-check`` adds to the path).

Without CUDA, ``--device cuda`` says so in one line and exits 0. ``--device cpu`` is a dry run of
the same steps at small sizes (batches 1,2; long batch 2, to ``--new-tokens`` or 16), writing to
``benchmarks/results/gpu/cpu-dry-run/`` unless told otherwise::

    make gpu-check DEVICE=cpu MODEL=random:qwen2.5-1.5b TOKENS=16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import compiled, scale
from .common import load_for, machine, write
from .settings import CompiledSettings, LongSettings

# Sizes when a flag is not given: the GPU run, and the CPU dry run of the same steps.
# Measured on one H200 (2026-11-27): the tests took 280 s and the compiled step 243 s at batch 64
# alone (six compiles), so batch 1 is left to BATCHES=1,64 and the long step needs TESTS=none.
SIZES = {"cuda": {"batches": "64", "long_batch": 32, "out_dir": "benchmarks/results/gpu"},
         "cpu": {"batches": "1,2", "long_batch": 2, "out_dir": "benchmarks/results/gpu/cpu-dry-run"}}
LONG_LENGTHS = (1024, 2048, 4096, 8192)  # the long benchmark's candidate lengths (no --long-lengths)
MODES = ("compiled", "eager")
# The long benchmark's time estimate is multiplied by this: full's step slows as its cache grows,
# and prefill, host checks and the JSON are not in the step time it is made from.
LONG_MARGIN = 1.5


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvsieve.bench.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=sorted(SIZES), help="cpu: a dry run at small sizes")
    ap.add_argument("--model", default="random:qwen2.5-7b", help="as the benchmarks take it (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="default: %(default)s")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--new-tokens", type=int, default=256, help="new tokens per row in the compiled benchmark")
    ap.add_argument("--batches", default=None, help="compiled benchmark batches (default 64; cpu: 1,2)")
    ap.add_argument("--budget", type=int, default=256, help="tova's budget in the compiled benchmark")
    ap.add_argument("--long-budget", type=int, default=1024, help="tova's budget in the long benchmark (1024)")
    ap.add_argument("--long-batch", type=int, default=None, help="default 32; cpu: 2")
    ap.add_argument("--long-lengths", default=None,
                    help="comma-separated; default: what the time left allows (cpu: --new-tokens, at least 16)")
    ap.add_argument("--long-mode", default="auto", choices=("auto", *MODES),
                    help="auto: whichever mode reaches the longer length in the time left (compiled on a tie, "
                         "and when --long-lengths is given)")
    ap.add_argument("--time-limit", type=float, default=510.0,
                    help="seconds from the start that the long benchmark's length is chosen to end within")
    ap.add_argument("--tests", default="tests/test_gpu.py", help="the gpu tests (pytest -m gpu); none: skip them")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results/gpu (cpu: .../gpu/cpu-dry-run)")
    args = ap.parse_args(argv)
    for key, value in SIZES[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.long_lengths is not None:
        args.long_lengths = [int(n) for n in args.long_lengths.split(",")]
    elif args.device == "cpu":  # a multiple of the host check, past the first (where the clock starts)
        args.long_lengths = [max(2 * scale.CHECK_EVERY, -(-args.new_tokens // scale.CHECK_EVERY) * scale.CHECK_EVERY)]
    return args


# ---------------------------------------------------------------------------- step 1: the gpu tests
def run_tests(path: str) -> dict:
    """pytest -m gpu on ``path`` in a child process, its output streamed; its last line kept."""
    if path == "none":
        return not_run("--tests none", "")
    if importlib.util.find_spec("pytest") is None:
        return not_run("pytest is not installed", " (make gpu-vendor puts it in .gpu-vendor/)")
    if not Path(path).exists():
        return not_run(f"{path} not found", " (run from the repository root)")
    src = str(Path(__file__).resolve().parents[2])  # so the child imports this kvsieve
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", "gpu", path], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    for line in child.stdout:
        print(line, end="", flush=True)
        last = line.strip(" =\n") or last
    status = {0: "ok", 5: "none collected"}.get(child.wait(), "failed")  # ok: every test passed or skipped
    return {"status": status, "summary": last}


def not_run(why: str, hint: str) -> dict:
    print(f"gpu tests: not run: {why}{hint}")
    return {"status": "not run", "summary": f"not run: {why}"}


# ---------------------------------------------------------------------------- step 3: how long to go
def long_plan(compiled_rows: list[dict], batch: int, modes: tuple[str, ...], seconds_left: float
              ) -> tuple[str, list[int]]:
    """The mode of ``modes`` that takes the long benchmark furthest in ``seconds_left`` (the first
    on a tie), and every one of ``LONG_LENGTHS`` up to the longest that full and tova both reach.

    Estimated from ``kvsieve full <mode>`` in the compiled benchmark at the smallest batch >=
    ``batch`` it measured (else its largest): its compile time plus its step time per token, for
    each of the two runs (full, tova), times ``LONG_MARGIN``."""
    runs = 2
    plans = []
    for mode in modes:
        rows = sorted((r for r in compiled_rows if r["entry"] == f"kvsieve full {mode}"), key=lambda r: r["batch"])
        ref = next((r for r in rows if r["batch"] >= batch), rows[-1])
        step_s = ref["batch"] / ref["tokens_per_s"]
        cost = {n: LONG_MARGIN * runs * (ref["compile_s"] + n * step_s) for n in LONG_LENGTHS}
        lengths = [n for n in LONG_LENGTHS if cost[n] <= seconds_left]
        plans.append((mode, lengths))
        print(f"long, {mode}: {step_s * 1e3:.1f} ms a step at batch {ref['batch']} and {ref['compile_s']:.0f} s to "
              f"compile; " + (f"{lengths[-1]} tokens take about {cost[lengths[-1]]:.0f} s" if lengths else
                              f"even {LONG_LENGTHS[0]} tokens take about {cost[LONG_LENGTHS[0]]:.0f} s")
              + f" of the {seconds_left:.0f} s left", flush=True)
    return max(plans, key=lambda plan: len(plan[1]))  # max keeps the first of equals


# ---------------------------------------------------------------------------- the summary table
# (name, width, format of a number): tokens/s to 0.1, ratios to 0.01
COLUMNS = (("step", 9, ""), ("batch", 5, "d"), ("entry", 40, ""), ("tok/s", 9, ".1f"), ("x hf eager", 10, ".2f"),
           ("x hf static", 11, ".2f"), ("x kvsieve full", 14, ".2f"), ("KV x full", 9, ".2f"))


def compiled_summary(rows: list[dict]) -> list[dict]:
    """Each entry's tokens/s against transformers' eager and static compiled generate, and
    against kvsieve's full in the same mode (eager or compiled), at the same batch."""
    def ratio(row, ref, key):
        return None if ref is None else row[key] / ref[key]

    out = []
    for r in rows:
        same_batch = {s["entry"]: s for s in rows if s["batch"] == r["batch"]}
        mode = r["entry"].rsplit(" ", 1)[-1]  # "... eager" or "... compiled"
        full = same_batch.get(f"kvsieve full {mode}") if r["entry"].startswith("kvsieve") else None
        out.append({"step": "compiled", "batch": r["batch"], "entry": r["entry"], "tok/s": r["tokens_per_s"],
                    "x hf eager": ratio(r, same_batch.get("transformers eager"), "tokens_per_s"),
                    "x hf static": ratio(r, same_batch.get("transformers static compiled"), "tokens_per_s"),
                    "x kvsieve full": ratio(r, full, "tokens_per_s"), "KV x full": ratio(r, full, "peak_kv_bytes")})
    return out


def long_summary(rows: list[dict], every: int, mode: str) -> list[dict]:
    """Per method and length: tokens/s over the whole run to it and over its last stretch, vs full."""
    out = []
    for r in rows:
        label = ("full" if r["method"] == "full" else f"{r['method']}@{r['budget']}") + f" {mode}"
        common = {"step": "long", "batch": r["batch"], "x hf eager": None, "x hf static": None}
        out.append({**common, "entry": f"{label}, mean over {r['new_tokens']} tokens",
                    "tok/s": r["decode_tokens_per_s"], "x kvsieve full": r["speed_vs_full"],
                    "KV x full": r["kv_bytes_vs_full"]})
        out.append({**common, "entry": f"{label}, last {every} to {r['new_tokens']}",
                    "tok/s": r["tokens_per_s_last_stretch"], "x kvsieve full": r["last_stretch_vs_full"],
                    "KV x full": None})
    return out


def print_table(title: str, rows: list[dict]) -> None:
    """``rows`` under the ``COLUMNS`` headings; text left-aligned, numbers right, ``-`` where none."""
    def cell(value, width, fmt):
        if value is None:
            return "-".rjust(width)
        return f"{value:{width}{fmt}}" if fmt else f"{value:{width}}"

    print(f"\n{title}")
    print(" ".join(f"{name:{width}}" if not fmt else f"{name:>{width}}" for name, width, fmt in COLUMNS))
    for row in rows:
        print(" ".join(cell(row.get(name), width, fmt) for name, width, fmt in COLUMNS))


# ---------------------------------------------------------------------------- main
def no_cuda_line() -> str | None:
    if torch.cuda.is_available():
        return None
    return (f"gpu-check: no CUDA device here (torch {torch.__version__}); nothing run. A dry run on the CPU: "
            f"make gpu-check DEVICE=cpu MODEL=random:qwen2.5-1.5b TOKENS=16")


def failed(step: str, err: Exception) -> dict:
    """A step that raised, as one summary row and one printed line; the check goes on."""
    line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    print(f"gpu-check: {step} failed: {line}", flush=True)
    return {"step": step, "entry": f"failed: {line}"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and (line := no_cuda_line()):
        print(line)
        return 0
    import transformers

    start = time.perf_counter()
    out = Path(args.out_dir)
    model_args = dict(model=args.model, device=args.device, dtype=args.dtype, threads=args.threads)
    steps: dict[str, float] = {}
    summary: list[dict] = []
    facts = {"torch": torch.__version__, "transformers": transformers.__version__}
    if args.device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()

    def save() -> None:  # after every step, so a run cut off at its time limit keeps what it finished
        write(out / "gpu_check.json", {"benchmark": "gpu_check", "model": args.model, "machine": facts,
                                       "settings": vars(args), "tests": tests, "step_s": steps,
                                       "total_s": time.perf_counter() - start, "summary": summary})

    print(f"== gpu-check 1/3: gpu tests ({args.tests})", flush=True)
    tests = run_tests(args.tests)
    steps["gpu tests"] = time.perf_counter() - start
    summary.append({"step": "gpu tests", "entry": tests["summary"]})
    save()

    print(f"\n== gpu-check 2/3: compiled-step benchmark, {args.model} in {args.dtype}, batches {args.batches}",
          flush=True)
    t0 = time.perf_counter()
    compiled_args = CompiledSettings(**model_args, methods="full,tova", budget=args.budget, new_tokens=args.new_tokens,
                                     batches=args.batches, out=str(out / "compiled.json"))
    model = tok = None
    compiled_rows: list[dict] = []
    try:
        model, tok = load_for(compiled_args)
        facts.update(machine(model))
        compiled_rows = compiled.run(model, tok, compiled_args)
        summary += compiled_summary(compiled_rows)
    except Exception as err:  # noqa: BLE001 - reported in the summary; the long step still runs
        summary.append(failed("compiled", err))
    steps["compiled benchmark"] = time.perf_counter() - t0
    save()

    print(f"\n== gpu-check 3/3: long generation, budget {args.long_budget}, batch {args.long_batch}", flush=True)
    t0 = time.perf_counter()
    modes = MODES if args.long_mode == "auto" else (args.long_mode,)
    if model is None:
        summary.append({"step": "long", "entry": "not run: no model (see the compiled step)"})
    else:
        if args.long_lengths:
            mode, lengths = modes[0], args.long_lengths
        elif compiled_rows:
            mode, lengths = long_plan(compiled_rows, args.long_batch, modes, args.time_limit - (t0 - start))
        else:  # no step times to plan from: the shortest length, eagerly
            mode, lengths = "eager", [LONG_LENGTHS[0]]
        if not lengths:
            summary.append({"step": "long", "entry": "not run: out of time"})
        else:
            long_args = LongSettings(**model_args, methods="tova", budget=args.long_budget, batch=args.long_batch,
                                     lengths=",".join(map(str, lengths)), out=str(out / "long.json"),
                                     compile=mode == "compiled")
            try:
                result = scale.run(model, tok, long_args)
                summary += long_summary(result["rows"], result["every"], mode)
            except Exception as err:  # noqa: BLE001 - reported in the summary
                summary.append(failed("long", err))
    steps["long benchmark"] = time.perf_counter() - t0
    save()

    total = time.perf_counter() - start
    times = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in steps.items())
    print_table(f"gpu-check: {args.model} in {args.dtype} on {facts.get('gpu', args.device)}, "
                f"torch {torch.__version__}, transformers {transformers.__version__}; {times}; total {total:.0f} s",
                summary)
    benchmarks_failed = any(str(row.get("entry", "")).startswith("failed") for row in summary)
    return 1 if tests["status"] == "failed" or benchmarks_failed else 0


if __name__ == "__main__":
    sys.exit(main())
