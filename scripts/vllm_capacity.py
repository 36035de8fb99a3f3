"""Many requests in a fixed KV space: plain vLLM against kvsieve's streaming, one engine per run,
stepped in-process so the scheduler's queues and block pool can be read each step (issue 49's
"memory given back"; the issue's benchmark reads the same from /metrics of a server).

    PYTHONPATH=src /work/vllm-env/bin/python scripts/vllm_capacity.py --requests 16 --new-tokens 512

Prints one JSON line per method: peak running requests, steps with requests waiting, preemptions,
peak blocks in use, wall time and output tokens/s.  Run both methods in one call: ratios between
runs on a shared machine are only meaningful within one call.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [
    "The history of the printing press begins",
    "In mathematics, a prime number is",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
]


def run(args, method: str) -> dict:
    from vllm import LLM, SamplingParams

    from kvsieve.models import ensure_bundled
    from kvsieve.vllm import engine_kwargs

    extra = {"enable_prefix_caching": False}
    if method != "plain":
        extra = engine_kwargs(method, args.budget, interval=args.interval)
    block_bytes = 30 * 3 * 64 * 2 * 4 * args.block_size  # fp32 SmolLM2-135M
    llm = LLM(model=str(ensure_bundled("smollm2-135m")), dtype="float32", enforce_eager=True,
              max_model_len=args.kv_blocks * args.block_size, block_size=args.block_size,
              kv_cache_memory_bytes=(args.kv_blocks + 1) * block_bytes, seed=0, **extra)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"q{i}", PROMPTS[i % len(PROMPTS)], params)
    t0 = time.perf_counter()
    steps = waiting_steps = peak_running = peak_blocks = tokens = 0
    preempted: dict[str, int] = {}  # request -> most preemptions seen
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        steps += 1
        peak_running = max(peak_running, len(scheduler.running))
        waiting_steps += bool(len(scheduler.waiting))
        peak_blocks = max(peak_blocks, total - pool.get_num_free_blocks())
        for r in scheduler.requests.values():
            preempted[r.request_id] = max(preempted.get(r.request_id, 0), r.num_preemptions)
    wall = time.perf_counter() - t0
    result = {"method": method, "budget": args.budget if method != "plain" else None, "requests": args.requests,
              "new_tokens": args.new_tokens, "pool_blocks": total, "block_size": args.block_size,
              "peak_running": peak_running, "steps": steps, "steps_with_waiting": waiting_steps,
              "preemptions": sum(preempted.values()), "peak_blocks": peak_blocks, "all_blocks_back": pool.get_num_free_blocks() == total,
              "wall_s": round(wall, 1), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1)}
    engine.engine_core.shutdown()
    del llm, engine, scheduler
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--kv-blocks", type=int, default=40, help="usable KV blocks (the fixed KV space)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--methods", default="plain,streaming")
    args = ap.parse_args()
    for method in args.methods.split(","):
        print(json.dumps(run(args, method)), flush=True)


if __name__ == "__main__":
    main()
