"""Issue 49's benchmark: at a fixed KV space, the largest concurrent batch and total output tokens/s
of plain vLLM against vLLM + kvsieve for several methods, ratios measured in one process run.

Every configuration gets a fresh in-process engine with the same pool of ``--kv-blocks`` blocks
and the same workload: ``--requests`` short prompts submitted at once, each decoding
``--new-tokens`` tokens greedily with EOS ignored (``vllm_capacity.measure``).  Configurations are
interleaved (plain, each method at each budget, plain again), so drift from the shared machine
shows as the two plain runs parting.  Prints one JSON line per run, then a table of ratios
kvsieve / plain against each plain run, and writes ``--out`` with the command line, the vLLM
version, the commit and the load averages before and after.

    PYTHONPATH=src /work/vllm-env/bin/python scripts/vllm_bench.py \\
        --requests 16 --new-tokens 1000 --kv-blocks 64 --budgets 64 --out results/vllm-bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts below

import vllm_capacity  # noqa: E402  (sets VLLM_ENABLE_V1_MULTIPROCESSING before vLLM loads)
from vllm_two_engines import METHODS  # noqa: E402  (each method's settings at a budget of 64)

ROOT = Path(__file__).resolve().parent.parent
RATIOS = ("largest_batch_no_preemption", "peak_running", "tokens_per_s", "preemptions", "steps_with_waiting",
          "peak_blocks")


def configurations(methods: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    """(method, budget) in run order: plain, every method at every budget, plain again."""
    return [("plain", None), *[(m, b) for b in budgets for m in methods], ("plain", None)]


def load() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def run_one(method: str, budget: int | None, *, requests: int, new_tokens: int, kv_blocks: int,
            block_size: int, interval: int) -> dict:
    """One configuration in a fresh engine, with the load averages around it."""
    before = load()
    llm = vllm_capacity.make_engine(method, budget, kv_blocks=kv_blocks, block_size=block_size,
                                    interval=interval, settings=METHODS.get(method, {}))
    try:
        result = vllm_capacity.measure(llm, requests, new_tokens)
    finally:
        vllm_capacity.close(llm)
    return {"method": method, "budget": budget, "interval": interval if budget else None,
            "block_size": block_size, **result, "load_before": before, "load_after": load()}


def bench(methods: list[str], budgets: list[int], *, requests: int, new_tokens: int, kv_blocks: int,
          block_size: int = 32, interval: int = 16, on_run=None) -> list[dict]:
    """Every configuration of ``configurations(methods, budgets)`` run once, in order;
    ``on_run(runs)``, when given, is called with the runs so far after each one."""
    runs = []
    for method, budget in configurations(methods, budgets):
        runs.append(run_one(method, budget, requests=requests, new_tokens=new_tokens, kv_blocks=kv_blocks,
                            block_size=block_size, interval=interval))
        if on_run:
            on_run(runs)
    return runs


def ratios(runs: list[dict]) -> list[dict]:
    """For each kvsieve run, each figure of ``RATIOS`` over the same figure of each plain run
    (``first``: the run before all methods, ``last``: the one after; None where plain's is 0)."""
    plains = [r for r in runs if r["method"] == "plain"]
    rows = []
    for r in runs:
        if r["method"] == "plain":
            continue
        row = {"method": r["method"], "budget": r["budget"]}
        for key in RATIOS:
            for name, p in (("first", plains[0]), ("last", plains[-1])):
                row[f"{key}_x_plain_{name}"] = round(r[key] / p[key], 2) if p[key] else None
        rows.append(row)
    return rows


def table(runs: list[dict]) -> str:
    """A Markdown table of every run's figures and, for kvsieve, its ratios to the two plain runs."""
    plains = [r for r in runs if r["method"] == "plain"]

    def x(r, key):
        return "/".join(f"{r[key] / p[key]:.2f}x" if p[key] else "-" for p in (plains[0], plains[-1]))

    lines = ["| run | budget | largest batch, no preemption | peak running | preemptions | steps waiting | "
             "peak blocks | wall s | tokens/s | batch x plain (first/last) | tokens/s x plain (first/last) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        plain = r["method"] == "plain"
        lines.append(f"| {i}. {r['method']} | {r['budget'] or '-'} | {r['largest_batch_no_preemption']} | "
                     f"{r['peak_running']} | {r['preemptions']} | {r['steps_with_waiting']} | {r['peak_blocks']} | "
                     f"{r['wall_s']} | {r['tokens_per_s']} | {'-' if plain else x(r, 'largest_batch_no_preemption')} | "
                     f"{'-' if plain else x(r, 'tokens_per_s')} |")
    return "\n".join(lines)


def commit() -> str:
    """HEAD's hash, with "+dirty" when the work tree has uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=1000, help="new tokens per request (prompts are ~10 tokens)")
    ap.add_argument("--kv-blocks", type=int, default=64,
                    help="usable KV blocks, the fixed KV space (default: what 16 requests need at budget 64, "
                         "interval 16, blocks of 32: 4 each)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--methods", default="streaming,keydiff,snapkv")
    ap.add_argument("--budgets", default="64", help="comma-separated, e.g. 64,128")
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--out", default=None, help="JSON file for the command, versions, load and every run")
    args = ap.parse_args()

    import vllm

    header = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "vllm": vllm.__version__,
              "commit": commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpus": os.cpu_count(), "load_before": load()}

    def report(runs):  # one JSON line per run, and the file rewritten: a cut-off run leaves what it measured
        print(json.dumps(runs[-1]), flush=True)
        if args.out:
            result = {**header, "load_after": load(), "runs": runs, "ratios": ratios(runs) if len(runs) > 1 else []}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    runs = bench(args.methods.split(","), [int(b) for b in args.budgets.split(",")], requests=args.requests,
                 new_tokens=args.new_tokens, kv_blocks=args.kv_blocks, block_size=args.block_size,
                 interval=args.interval, on_run=report)
    print(table(runs), flush=True)


if __name__ == "__main__":
    main()
