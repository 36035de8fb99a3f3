"""Per-step cost of every policy: decode time per token with the policy vs ``full`` at the
same live cache length, so the ratio isolates scoring + compaction (and, for methods that
observe attention every step, the explicit attention rows they need).

The cache of every layer is filled with ``length`` random post-RoPE keys/values (decode speed
does not depend on their values); each timed step runs one real forward pass of the model on
one token per row, then the policy's compression (its budget is ``length``, so every step
evicts exactly what the step appended; methods compressing every ``interval`` steps are
charged their amortised cost by timing ``interval`` steps). ``full`` runs the same forward pass
over the same length without compressing.  Each method runs ``--rounds`` times, interleaved
with the others, and its fastest round counts (a shared machine's drift hits every method).

    kvsieve bench overhead --model smollm2-135m --lengths 512,2048 --batches 1,8
"""

from __future__ import annotations

import argparse
import time

import torch

from kvsieve import make_policy
from kvsieve.attention import ATTN_IMPLEMENTATION, StepState
from kvsieve.cache import SieveCache
from kvsieve.bench.common import add_model_args, load_for, machine, profiled, write
from kvsieve.methods import method_names
from kvsieve.policy import SCORERS, compress


def filled_cache(model, policy, batch: int, length: int, steps: int) -> SieveCache:
    """Every layer holds ``length`` random tokens, allocated once for the whole timed run (a
    bounded policy at budget + interval, ``full`` at length + steps) so no step pays a growth."""
    cfg = model.config
    H, D = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scorer = policy.scorer
    cache = SieveCache(cfg.num_hidden_layers, meta_init=scorer.meta_init if scorer else None)
    pos = torch.arange(length, device=model.device).expand(batch, length)
    g = torch.Generator(device=model.device).manual_seed(0)
    budgets = policy.layer_budgets(cfg.num_hidden_layers)
    for layer, budget in zip(cache.layers, budgets):
        layer.query_window = scorer.query_window() if scorer else 0
        layer.capacity_hint = length + (policy.interval if scorer else steps + 2)
        cache.begin_step(pos)
        kv = torch.randn(2, batch, H, length, D, generator=g, device=model.device, dtype=model.dtype)
        layer.update(kv[0], kv[1], pos)
        layer.reserve(layer.capacity_hint)
        if layer.query_window:
            w = min(layer.query_window, length)
            layer.remember_queries(torch.randn(batch, cfg.num_attention_heads, w, D, generator=g,
                                               device=model.device, dtype=model.dtype), pos[:, -w:])
        layer.scaling = D ** -0.5
    cache.seen_tokens = torch.full((batch,), length, dtype=torch.long, device=model.device)
    return cache


@torch.inference_mode()
def time_method(model, method: str, batch: int, length: int, steps: int, max_interval: int = 32) -> float:
    """Seconds per decode step (forward + the policy's amortised compression).  Methods that
    compress every I > ``max_interval`` steps (AMS 512, SkipKV 128) are timed at I = ``max_interval``:
    their compression is charged more often than by default, so the figure is an upper bound."""
    if method != "full" and not SCORERS[method.split(":")[-1]].uses_budget:
        return float("nan")  # no budget to hold the length at (LagKV)
    settings = {"window": 16} if method == "lazy" else {}
    policy = make_policy(method, budget=None if method == "full" else length, **settings)
    if policy.scorer is not None and policy.interval > max_interval:
        policy = make_policy(method, budget=length, interval=max_interval, **settings)
    interval = policy.interval if policy.scorer else 1
    n = max(steps, interval) // interval * interval
    cache = filled_cache(model, policy, batch, length, n)
    budgets = policy.layer_budgets(model.config.num_hidden_layers)
    observer = policy.observer()
    token = torch.zeros(batch, 1, dtype=torch.long, device=model.device)

    def step(i):
        qpos = cache.seen_tokens[:, None]
        cache.begin_step(qpos)
        model(input_ids=token, position_ids=qpos, past_key_values=cache, use_cache=True, logits_to_keep=1,
              kvsieve=StepState(cache=cache, query_pos=qpos, observer=observer))
        cache.seen_tokens = cache.seen_tokens + 1
        if policy.scorer is not None and (i + 1) % interval == 0 and policy.needs_compression(cache, budgets):
            compress(cache, policy, budgets)

    for i in range(min(2, n)):  # warm-up
        step(i)
    if policy.scorer is None:  # keep full at the same length: rebuild after the warm-up
        cache = filled_cache(model, policy, batch, length, n)
    _sync(model)
    t0 = time.perf_counter()
    for i in range(n):
        step(i)
    _sync(model)
    return (time.perf_counter() - t0) / n


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
    ap.add_argument("--max-interval", type=int, default=32,
                    help="time interval methods (AMS, SkipKV) at most every this many steps (an upper bound)")
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
                    best[method] = min(best[method], time_method(model, method, batch, length, args.steps,
                                                                  args.max_interval))
            full = best["full"]
            print(f"batch {batch} length {length}: full {full * 1e3:.1f} ms/step", flush=True)
            for method in methods[1:]:
                t = best[method]
                overhead = t / full - 1
                rows.append({"batch": batch, "length": length, "method": method, "ms_per_step": t * 1e3,
                             "full_ms_per_step": full * 1e3, "overhead_vs_full": overhead})
                print(f"  {method:14s} {t * 1e3:8.1f} ms/step  overhead {overhead * 100:+6.1f}%", flush=True)
    return rows


if __name__ == "__main__":
    main()
