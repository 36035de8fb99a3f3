"""Many requests in a fixed KV space: plain vLLM against kvsieve's streaming, one engine per run,
stepped in-process so the scheduler's queues and block pool can be read each step (issue 49's
"memory given back"; the issue's benchmark reads the same from /metrics of a server).

    PYTHONPATH=src /work/vllm-env/bin/python scripts/vllm_capacity.py --requests 16 --new-tokens 512

Each method runs with the options ``scripts/serve_bench.py`` serves it with (TriAttention's
statistics, ``--stats``).  Prints one JSON line per method: peak running requests, the largest
batch that ran to its end without a preemption, steps with requests waiting, preemptions, peak
blocks in use, wall time and output tokens/s, and the compactions with the share of step time
spent compacting (the worker's own timers).  Run all methods in one call: ratios between runs on
a shared machine are only meaningful within one call.  ``scripts/vllm_bench.py`` builds the
issue's benchmark on ``measure``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [
    "The history of the printing press begins",
    "In mathematics, a prime number is",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
]
# fp32 SmolLM2-135M: 30 layers x 3 kv heads x 64 dims x 2 (k, v) x 4 bytes per token
TOKEN_BYTES = 30 * 3 * 64 * 2 * 4


def make_engine(method: str, budget: int | None, *, kv_blocks: int, block_size: int, interval: int | None,
                settings: dict | None = None, max_model_len: int | None = None, max_num_seqs: int | None = None):
    """An in-process ``vllm.LLM`` on the bundled SmolLM2-135M (fp32, eager) whose KV space is
    ``kv_blocks`` usable blocks of ``block_size`` tokens: plain vLLM (prefix caching off) when
    ``method`` is "plain", else kvsieve's classes serving ``method`` at ``budget`` with
    ``interval`` (None: the serving default, a compaction when a request's next token needs a
    block) and the method's other ``settings`` (``engine_kwargs`` keywords).  ``max_model_len``
    (default: the pool, up to 8,192) and ``max_num_seqs`` (default: vLLM's) bound what H2O's,
    LazyEviction's and RaaS's query rings reserve per request slot."""
    from vllm import LLM

    from kvsieve.models import ensure_bundled
    from kvsieve.vllm import engine_kwargs

    extra = {"enable_prefix_caching": False}
    if method != "plain":
        extra = engine_kwargs(method, budget, interval=interval, **(settings or {}))
    # one block more than asked: vLLM keeps block 0 as its null block.  vLLM refuses a pool smaller
    # than one max_model_len request, so max_model_len is the pool, up to the model's 8,192 positions.
    sizes = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    return LLM(model=str(ensure_bundled("smollm2-135m")), dtype="float32", enforce_eager=True,
               max_model_len=max_model_len or min(kv_blocks * block_size, 8192), block_size=block_size,
               kv_cache_memory_bytes=(kv_blocks + 1) * TOKEN_BYTES * block_size, seed=0, **sizes, **extra)


def engine_parts(llm):
    """(engine, scheduler, block pool) of an in-process ``llm``.  Reads vLLM 0.32's internals
    (``engine_core.engine_core.scheduler``, ``kv_cache_manager.block_pool``): the only place here
    that does; they hold with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    return engine, scheduler, scheduler.kv_cache_manager.block_pool


def largest_batch_without_preemption(running: list[tuple[str, ...]], last_preempted: dict[str, int]) -> int:
    """The most requests that ran together at one step and each then ran to its end with no
    preemption: ``running[s]`` the requests running after step ``s``, ``last_preempted[r]`` the
    step of ``r``'s last preemption (absent: never preempted)."""
    return max((sum(last_preempted.get(r, -1) <= s for r in ids) for s, ids in enumerate(running)), default=0)


def measure(llm, requests: int, new_tokens: int) -> dict:
    """Submit ``requests`` greedy requests of ``new_tokens`` new tokens each (EOS ignored) at once,
    step the engine until all finish, and return what its scheduler showed each step."""
    from vllm import SamplingParams

    engine, scheduler, pool = engine_parts(llm)
    total = pool.num_gpu_blocks - 1  # less the null block
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"q{i}", PROMPTS[i % len(PROMPTS)], params)
    t0 = time.perf_counter()
    waiting_steps = peak_blocks = tokens = 0
    running: list[tuple[str, ...]] = []  # per step, the requests running after it
    preemptions: dict[str, int] = {}  # request -> preemptions seen
    last_preempted: dict[str, int] = {}  # request -> step of its last preemption
    short = 0  # requests that finished with fewer than new_tokens tokens
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                short += len(out.outputs[0].token_ids) < new_tokens
        step = len(running)
        running.append(tuple(r.request_id for r in scheduler.running))
        waiting_steps += bool(len(scheduler.waiting))
        peak_blocks = max(peak_blocks, total - pool.get_num_free_blocks())
        for r in scheduler.requests.values():
            if r.num_preemptions > preemptions.get(r.request_id, 0):
                preemptions[r.request_id] = r.num_preemptions
                last_preempted[r.request_id] = step
    wall = time.perf_counter() - t0
    worker = llm.collective_rpc("kvsieve_stats")[0] if hasattr(scheduler, "sieve_stats") else {}
    share = round(worker["compact_s"] / worker["step_s"], 4) if worker.get("step_s") else None
    return {"requests": requests, "new_tokens": new_tokens, "pool_blocks": total,
            "peak_running": max(map(len, running), default=0),
            "largest_batch_no_preemption": largest_batch_without_preemption(running, last_preempted),
            "steps": len(running), "steps_with_waiting": waiting_steps, "preemptions": sum(preemptions.values()),
            "peak_blocks": peak_blocks, "all_blocks_back": pool.get_num_free_blocks() == total,
            "short_requests": short, "wall_s": round(wall, 1), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "compactions": worker.get("compactions"),
            "compacting_share": share}


def close(llm) -> None:
    """Shut ``llm``'s in-process engine core down and free it before the next engine starts."""
    engine, _, _ = engine_parts(llm)
    engine.engine_core.shutdown()
    del llm, engine
    gc.collect()


def run(args, method: str, settings: dict | None = None) -> dict:
    """One engine for ``method`` with ``args``' sizes: started, measured, shut down."""
    budget = args.budget if method != "plain" else None
    llm = make_engine(method, budget, kv_blocks=args.kv_blocks, block_size=args.block_size,
                      interval=args.interval, settings=settings, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs)
    try:
        result = measure(llm, args.requests, args.new_tokens)
    finally:
        close(llm)
    return {"method": method, "budget": budget, **result, "block_size": args.block_size}


def served_settings(args, method: str) -> dict | None:
    """The options ``scripts/serve_bench.py`` serves ``method`` with (TriAttention's statistics
    file, LagKV's off-grid budget, ...), as ``engine_kwargs`` keywords; None for plain vLLM.
    ``serve_bench.BenchError`` in one line when kvsieve refuses them."""
    if method == "plain":
        return None
    from serve_bench import TRIATTENTION_STATS, method_settings

    horizon = args.max_model_len or min(args.kv_blocks * args.block_size, 8192)
    settings = method_settings(method, args.budget, args.interval, args.stats or str(TRIATTENTION_STATS),
                               horizon=horizon)
    return {key: value for key, value in settings.items() if key not in ("budget", "interval")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--kv-blocks", type=int, default=40, help="usable KV blocks (the fixed KV space)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--interval", type=int, default=None,
                    help="decode steps between compactions (default: when a request's next token needs a block)")
    ap.add_argument("--methods", default="plain,streaming")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the pool, up to 8,192 tokens")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    ap.add_argument("--stats", default=None, help="TriAttention's statistics file (default: serve_bench's)")
    args = ap.parse_args()
    from serve_bench import BenchError

    methods = args.methods.split(",")
    try:
        settings = {method: served_settings(args, method) for method in methods}
    except BenchError as err:
        sys.exit(f"vllm_capacity: {err}")
    for method in methods:
        print(json.dumps(run(args, method, settings[method])), flush=True)


if __name__ == "__main__":
    main()
