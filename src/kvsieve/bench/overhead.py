"""Per-step cost of every policy: decode time per token with the policy vs ``full`` at the
same live cache length, so the ratio isolates scoring + compaction (and, for methods that
observe attention every step, the explicit attention rows they need).

The cache of every layer is filled with ``length`` random post-RoPE keys/values (decode speed
does not depend on their values); each timed step runs one real forward pass of the model on
one token per row, then the policy's compression (its budget is ``length``, so every step
evicts exactly what the step appended; methods compressing every ``interval`` steps are
charged one timed compression over ``interval`` steps, see ``time_method``). ``full`` runs the same forward pass
over the same length without compressing.  Each method runs ``--rounds`` times, interleaved
with the others, and its fastest round counts (a shared machine's drift hits every method).

    kvsieve bench overhead --model smollm2-135m --lengths 512,2048 --batches 1,8

With ``--budget B`` the policies instead hold B tokens while ``full`` holds ``length``: the
same timed steps then give the decode rate of a bounded cache once ``length`` tokens exist
vs a full cache of that length (tokens/s ratio = full's ms/step over the policy's).

    kvsieve bench overhead --model smollm2-135m --lengths 8192 --batches 8 --budget 256 --methods tova
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvsieve import make_policy
from kvsieve.attention import ATTN_IMPLEMENTATION, StepState
from kvsieve.cache import SieveCache
from kvsieve.bench.common import add_model_args, load_for, machine, profiled, write
from kvsieve.methods import method_names
from kvsieve.policy import SCORERS, compress


def filled_cache(model, policy, batch: int, length: int, steps: int, first_pos: int = 0) -> SieveCache:
    """Every layer holds ``length`` random tokens at positions ``first_pos`` onwards, allocated
    once for the whole timed run (a bounded policy at budget + interval, ``full`` at length +
    steps) so no step pays a growth."""
    cfg = model.config
    scorer = policy.scorer
    cache = SieveCache(cfg.num_hidden_layers, meta_init=scorer.meta_init if scorer else None)
    cache.seen_tokens = torch.full((batch,), first_pos, dtype=torch.long, device=model.device)
    append_random(model, cache, length)
    pos = torch.arange(first_pos, first_pos + length, device=model.device).expand(batch, length)
    g = torch.Generator(device=model.device).manual_seed(0)
    D = cache.layers[0].keys.shape[-1]
    for layer in cache.layers:
        layer.query_window = scorer.query_window() if scorer else 0
        layer.capacity_hint = length + (policy.interval if scorer else steps + 2)
        layer.reserve(layer.capacity_hint)
        if layer.query_window:
            w = min(layer.query_window, length)
            layer.remember_queries(torch.randn(batch, cfg.num_attention_heads, w, D, generator=g,
                                               device=model.device, dtype=model.dtype), pos[:, -w:])
        layer.scaling = D ** -0.5
    return cache


def append_random(model, cache: SieveCache, count: int) -> None:
    """Append ``count`` random tokens to every layer (untimed), as if ``count`` steps had run
    (rows and positions come from ``cache.seen_tokens``)."""
    cfg = model.config
    H = cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    B = cache.seen_tokens.shape[0]
    pos = cache.seen_tokens[:, None] + torch.arange(count, device=model.device)
    g = torch.Generator(device=model.device).manual_seed(1)
    for layer in cache.layers:
        cache.begin_step(pos)
        kv = torch.randn(2, B, H, count, D, generator=g, device=model.device, dtype=model.dtype)
        layer.update(kv[0], kv[1], pos)
    cache.seen_tokens = cache.seen_tokens + count


@torch.inference_mode()
def time_method(model, method: str, batch: int, length: int, steps: int, budget: int | None = None) -> float:
    """Seconds per decode step: the forward pass plus the policy's compression amortised over
    its interval I.  Every-step methods (I = 1) run ``steps`` steps exactly as in ``generate``,
    each compressing.  Interval methods (SnapKV 64, SkipKV 128, AMS 512, ...) time min(steps, I)
    forward steps (their per-step observation included); the cache is then topped up with
    random tokens to budget + I, untimed, and one compression is timed and charged 1/I per step.
    A policy holds ``budget`` tokens (default ``length``) after ``length`` tokens were seen."""
    if method != "full" and not SCORERS[method.split(":")[-1]].uses_budget:
        return float("nan")  # no budget to hold the length at (LagKV)
    held = length if budget is None or method == "full" else budget
    settings = {"window": 16} if method == "lazy" else {}
    policy = make_policy(method, budget=None if method == "full" else held, **settings)
    interval = policy.interval if policy.scorer else 1
    n = steps if interval == 1 else min(steps, interval)
    budgets = policy.layer_budgets(model.config.num_hidden_layers)
    observer = policy.observer()
    token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)

    def fresh():
        return filled_cache(model, policy, batch, held, n + 2, first_pos=length - held)

    def step(cache):
        qpos = cache.seen_tokens[:, None]
        cache.begin_step(qpos)
        model(input_ids=token, position_ids=qpos, past_key_values=cache, use_cache=True, logits_to_keep=1,
              kvsieve=StepState(cache=cache, query_pos=qpos, observer=observer))
        cache.seen_tokens = cache.seen_tokens + 1
        if interval == 1 and policy.scorer is not None and policy.needs_compression(cache, budgets):
            compress(cache, policy, budgets)

    cache = fresh()
    for _ in range(2):  # warm-up
        step(cache)
    if interval > 1 or policy.scorer is None:  # time the forward steps at the held length
        cache = fresh()
    _sync(model)
    t0 = time.perf_counter()
    for _ in range(n):
        step(cache)
    _sync(model)
    per_step = (time.perf_counter() - t0) / n
    if interval > 1:
        compress_s = float("inf")
        for _ in range(2):  # the first compression warms up; the faster one counts
            append_random(model, cache, held + interval - cache.layers[0].live().sum(-1).max().item())
            _sync(model)
            t0 = time.perf_counter()
            compress(cache, policy, budgets)
            _sync(model)
            compress_s = min(compress_s, time.perf_counter() - t0)
        per_step += compress_s / interval
    return per_step


def _sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--methods", default=",".join(m for m in method_names() if m != "full"))
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the fastest counts")
    ap.add_argument("--budget", type=int, default=None,
                    help="policies hold this many tokens while full holds the length (decode speed-up)")
    ap.add_argument("--out", default="benchmarks/results/policy_overhead.json")
    args = ap.parse_args(argv)
    model, _ = load_for(args)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with profiled(args.profile):
            rows = measure(model, args)
    finally:
        model.set_attn_implementation(previous)
    write(args.out, {"benchmark": "overhead", "model": args.model, "machine": machine(model), "rows": rows})


def measure(model, args) -> list[dict]:
    rows = []
    for batch in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            methods = ["full", *[m for m in args.methods.split(",") if m != "full"]]
            best = {m: float("inf") for m in methods}
            for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits all alike
                for method in methods:
                    t = time_method(model, method, batch, length, args.steps, args.budget)
                    best[method] = t if math.isnan(t) else min(best[method], t)
            full = best["full"]
            print(f"batch {batch} length {length}: full {full * 1e3:.1f} ms/step", flush=True)
            for method in methods[1:]:
                t = best[method]
                if math.isnan(t):
                    print(f"  {method:14s} not timed: no token budget to hold the length at", flush=True)
                    continue
                overhead = t / full - 1
                rows.append({"batch": batch, "length": length, "budget": args.budget, "method": method,
                             "ms_per_step": t * 1e3, "full_ms_per_step": full * 1e3, "overhead_vs_full": overhead,
                             "speedup_vs_full": full / t})
                versus = (f"overhead {overhead * 100:+6.1f}%" if args.budget is None
                          else f"{full / t:5.2f}x full's tokens/s (holding {args.budget} of {length} tokens)")
                print(f"  {method:14s} {t * 1e3:8.1f} ms/step  {versus}", flush=True)
    return rows


if __name__ == "__main__":
    main()
