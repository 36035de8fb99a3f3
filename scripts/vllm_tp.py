"""Tensor parallelism (issue 58): vLLM + kvsieve at ``--tensor-parallel-size 2`` against 1.

Each worker of TP=2 holds one of Qwen2.5-Coder-0.5B's two kv heads (14 query heads) and compacts
only that head, with the count the scheduler planned for every worker.  A method whose scores are
each kv head's own (``plan.unsplit`` passes it) should then keep on each worker what the single
worker of TP=1 keeps for that head.  For each method: the same GSM8K prompts (token ids), greedy
fp32, the same budget, interval and window as the two-engine script, tokens of TP=2 against TP=1
per row.  The baseline is plain vLLM's TP=2 against its TP=1: the all-reduce of TP=2 sums the
heads' partial outputs in another order, so rows can part with no eviction at all, and a method's
rows are read against it (``identical_where_plain_agrees``).

Each TP=2 worker is bound to cores of its own (``VLLM_CPU_OMP_THREADS_BIND="0|1"`` on this machine,
set for the TP=2 runs as ``kvsieve serve`` sets it, ``preflight.bind_workers``; without it vLLM's
CPU worker asserts that one NUMA node cannot hold two workers).
Run from the vLLM environment, nothing else running (two worker processes take both cores):

    PYTHONPATH=src .vllm-env/bin/python scripts/vllm_tp.py --prompts 10 --new-tokens 32 \\
        --methods streaming,h2o,snapkv,tova-group --out results/vllm-tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script below

from vllm_two_engines import METHODS, chosen, compare, gsm8k_prompts, save, vllm_tokens  # noqa: E402

MODEL = "qwen2.5-coder-0.5b"  # 14 heads / 2 kv heads: divides by 2 (SmolLM2's 9 / 3 do not)
# the two-engine script's settings, and TOVA scoring each kv head alone (its default averages a
# layer's kv heads, which the workers combine: store.heads_combiner)
SETTINGS = {**METHODS, "tova-group": {"method": "tova", "options": {"heads": "group"}}}


def tokens_at(tp: int, model_dir: str, prompts, new_tokens: int, config: dict | None, max_model_len: int):
    """``vllm_tokens`` at tensor-parallel size ``tp``, each worker on cores of its own when tp > 1,
    as ``kvsieve serve`` binds them (``preflight.bind_workers``: this process's cores split between
    the workers where vLLM's own binding cannot place them, a binding already set kept)."""
    from kvsieve.vllm.preflight import ServeOptions, bind_workers, numa_node_count

    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    try:
        bind = bind_workers(ServeOptions(tensor_parallel_size=tp), dict(os.environ), sorted(os.sched_getaffinity(0)),
                            numa_node_count())
    except ValueError as err:
        raise SystemExit(f"vllm_tp: {err}") from None
    if bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    try:
        return vllm_tokens(model_dir, prompts, new_tokens, config, max_model_len, tensor_parallel_size=tp)
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="streaming,h2o,snapkv,tova-group",
                    help="comma-separated, from: " + ", ".join(SETTINGS))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default="results/vllm-tp.json")
    ap.add_argument("--triattention-stats", default=None, metavar="FILE",
                    help="TriAttention's statistics of the model (kvsieve calibrate triattention --model "
                         f"{MODEL}): with it, --methods may name triattention (its official defaults)")
    args = ap.parse_args()
    settings = chosen(ap, args.methods, SETTINGS, args.triattention_stats)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the scheduler's counters
    from transformers import AutoConfig, AutoTokenizer

    from kvsieve.models import ensure_bundled
    from kvsieve.vllm.plan import SieveSettings, unsplit

    t0 = time.perf_counter()
    model_dir = str(ensure_bundled(MODEL))
    prompts = gsm8k_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    max_model_len = max(map(len, prompts)) + args.new_tokens + 32
    hf_config = AutoConfig.from_pretrained(model_dir)
    plain = {tp: tokens_at(tp, model_dir, prompts, args.new_tokens, None, max_model_len)[0] for tp in (1, args.tp)}
    result = {"model": MODEL, "dtype": "float32", "prompts": len(prompts), "data": "gsm8k_test.jsonl",
              "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens, "budget": args.budget,
              "interval": args.interval, "tp": args.tp, "baseline_plain": compare(plain[args.tp], plain[1]),
              "methods": {}}
    agree = [i for i, same in enumerate(result["baseline_plain"]["identical"]) if same]
    print(json.dumps({"baseline_plain_identical_share": result["baseline_plain"]["identical_share"]}), flush=True)
    for name in settings:
        own = dict(settings[name])
        cfg = {"method": own.pop("method", name.split("@")[0]), "budget": args.budget, "interval": args.interval,
               "horizon": max(map(len, prompts)) + args.new_tokens, **own}
        why = unsplit(SieveSettings.from_config(cfg).for_model(hf_config).policy)
        if why:  # refused at TP > 1 by design: recorded, not run
            result["methods"][name] = {"refused": why}
            continue
        started = time.perf_counter()
        runs = {}
        try:
            for tp in (1, args.tp):
                runs[tp] = tokens_at(tp, model_dir, prompts, args.new_tokens, cfg, max_model_len)
        except Exception as err:  # one method's failure is reported, and the others still run
            result["methods"][name] = {"error": f"{type(err).__name__}: {err}"}
            print(json.dumps({name: result["methods"][name]}), flush=True)
            continue
        row = compare(runs[args.tp][0], runs[1][0])
        row["compactions"] = {str(tp): runs[tp][1] for tp in runs}
        row["identical_where_plain_agrees"] = sum(row["identical"][i] for i in agree) / max(1, len(agree))
        row["seconds"] = round(time.perf_counter() - started, 1)
        result["methods"][name] = row
        save(result, args.out)
        print(json.dumps({name: {k: row[k] for k in ("identical_share", "identical_where_plain_agrees",
                                                      "mean_first_divergence", "compactions")}}), flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
