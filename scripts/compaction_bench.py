"""What one step's compaction costs in vLLM's worker, with its bound on a scoring's tensors
(``store.STACK_BYTES``: layers stacked, ``store._Batch.stacks``, and requests split,
``store.split_rows``) against none (one layer and every request at a time; the "per layer"
column).  Plain torch, no vLLM: the worker's own ``store.compress_requests`` on paged caches of
SmolLM2-135M's shape.

    PYTHONPATH=src .venv/bin/python scripts/compaction_bench.py --requests 16,64 \\
        --out results/compaction-stacked.json

Each trial is one step of the served schedule at the defaults: R requests, each holding
``budget + block`` tokens (the budget kept at its last compaction and one block decoded since),
compressed back to the budget; a replaying scorer replays the block's queries.  Both ways run on
the same caches, alternating, in one process; the table prints the median milliseconds of each
and their ratio, and checks that both keep the same positions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from kvsieve.models import ensure_bundled
from kvsieve.vllm.paged import CpuLayout
from kvsieve.vllm.plan import Compaction, SieveSettings, count_of
from kvsieve.vllm.rings import QueryRecorder
from kvsieve.vllm.store import STACK_BYTES, RequestState, compress_requests

METHODS = "streaming,tova,h2o,snapkv,expected,rkv,lazy,raas,lagkv,ams:tova,caote:tova,keydiff"


def trial(settings: SieveSettings, args, requests: int, stack_bytes: int, seed: int):
    """One step's compaction of ``requests`` requests: (seconds, every request's kept positions)."""
    g = torch.Generator().manual_seed(seed)
    L, H, HQ, D, B = args.layers, args.kv_heads, args.heads, args.head_dim, args.block
    prompt, logical = args.prompt, args.prompt + args.decoded
    keep = count_of(settings, prompt, logical)
    kv_len = min(logical, count_of(settings, prompt, logical - B) + B)
    blocks = -(-kv_len // B)
    caches = [torch.randn(requests * blocks, H, B, 2 * D, generator=g) for _ in range(L)]
    ring = max(settings.policy.scorer.needs.query_window, B)  # the query window, or the block replayed
    rings = QueryRecorder([str(layer) for layer in range(L)], requests, ring, HQ, D, torch.float32)  # as the worker's
    rings.plan([f"r{r}" for r in range(requests)], [r * ring for r in range(requests)],
               [(r + 1) * ring for r in range(requests)])
    for layer in range(L):
        rings.record(str(layer), torch.randn(requests * ring, HQ, D, generator=g))
    items = []
    for r in range(requests):
        state = RequestState()
        kept = kv_len - B  # kept at the last compaction, a block ago
        state.pos = torch.arange(logical - B - kept, logical - B).expand(L, H, kept).clone()
        state.next_pos = logical - B
        ids = tuple(range(r * blocks, (r + 1) * blocks))
        items.append((state, Compaction(f"r{r}", ids, kv_len=kv_len, keep=keep, kept_blocks=blocks,
                                        logical_len=logical, prompt_len=prompt)))
    start = time.perf_counter()
    failed = compress_requests(settings.policy, CpuLayout(), caches, [D ** -0.5] * L, items, rings, stack_bytes)
    seconds = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{settings.method}: {failed}")
    return seconds, [state.pos for state, _ in items]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--requests", default="16,64")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=150, help="prompt tokens (GSM8K prompts: 100-200)")
    parser.add_argument("--decoded", type=int, default=500, help="tokens generated before this step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the worker's one thread per core
    config = AutoConfig.from_pretrained(ensure_bundled("smollm2-135m"))  # RoPE base and family, as vLLM's
    rows = []
    print(f"{'method':12} {'R':>3} {'per layer ms':>13} {'stacked ms':>11} {'ratio':>6}")
    for method in args.methods.split(","):
        settings = SieveSettings.from_config({"method": method, "budget": args.budget}).for_model(config)
        for requests in map(int, args.requests.split(",")):
            times = {"per_layer": [], "stacked": []}
            for rep in range(args.repeats):
                per_layer, kept_a = trial(settings, args, requests, 0, rep)
                stacked, kept_b = trial(settings, args, requests, STACK_BYTES, rep)
                if not all(torch.equal(a, b) for a, b in zip(kept_a, kept_b)):
                    raise SystemExit(f"{method}: stacked layers keep other positions than one layer at a time")
                times["per_layer"].append(per_layer)
                times["stacked"].append(stacked)
            a, b = (statistics.median(times[k]) * 1e3 for k in ("per_layer", "stacked"))
            rows.append({"method": method, "requests": requests, "per_layer_ms": round(a, 2),
                         "stacked_ms": round(b, 2), "speedup": round(a / b, 2)})
            print(f"{method:12} {requests:3d} {a:13.1f} {b:11.1f} {a / b:6.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
