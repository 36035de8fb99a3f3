"""Bounded caches at scale: memory vs generated length, throughput under a KV memory limit,
and long generation. Each figure is a ratio to ``full`` measured in the same run.

    kvsieve bench memory     --new-tokens 8192 --budget 256 --methods tova,lazy,streaming
    kvsieve bench throughput --kv-memory-gb 0.25 --new-tokens 512 --budget 128 --methods tova,streaming
    kvsieve bench long       --lengths 4096,8192 --budget 512 --methods tova,lazy --batch 8

``--kv-memory-gb`` is in GiB (2**30 bytes).  ``long`` defaults to the comparison of issue 7
(full vs tova and lazy at budget 512); the others to tova and streaming at budget 256.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from ..generate import GenerateConfig
from ..memory import max_batch_size
from ..methods import make_policy
from .common import machine, plot, profiled, timed_generate, tokens_per_s_between, write
from .settings import ScaleSettings, names, numbers


CHECK_EVERY = GenerateConfig.check_every  # decode steps between host checks: where clock readings land


def run_each(model, tok, args: ScaleSettings, new_tokens: int, **timing) -> list[dict]:
    """``timed_generate`` for ``full`` and then each of ``--methods``, reporting each run as it ends."""
    runs = []
    for method in ["full", *names(args.methods)]:
        runs.append(timed_generate(model, tok, method, args.budget, args.batch, new_tokens, compile=args.compile,
                                   **timing))
        print(f"{method}: {new_tokens} tokens x {args.batch} rows in {runs[-1]['wall_s']:.0f} s", flush=True)
    return runs


def memory(model, tok, args: ScaleSettings) -> dict:
    """Peak allocated KV bytes as ``--batch`` rows generate ``new_tokens``: full grows, bounded stays flat."""
    rows = run_each(model, tok, args, args.new_tokens)
    full = rows[0]
    print(f"{'method':12} {'peak KV bytes':>15} {'x full':>7} {'bytes at half way':>18} {'at the end':>12}")
    for r in rows:
        trace = r["kv_bytes_trace"]
        half = max((b for s, b in trace if s <= args.new_tokens // 2), default=0)
        end = trace[-1][1] if trace else 0
        r["kv_bytes_half"], r["kv_bytes_end"] = half, end
        print(f"{r['method']:12} {r['peak_kv_bytes']:15,} {r['peak_kv_bytes'] / full['peak_kv_bytes']:7.3f} "
              f"{half:18,} {end:12,}")

    def draw(ax):
        for r in rows:
            trace = [*r["kv_bytes_trace"], (r["new_tokens"], r["kv_bytes_trace"][-1][1])]  # flat to the end
            steps, sizes = zip(*trace)
            ax.step(steps, [s / 2**20 for s in sizes], where="post", label=r["method"])
        ax.set(xlabel="generated tokens", ylabel="allocated KV (MiB)", title=f"{args.model}, budget {args.budget}")
        ax.legend()

    return {"rows": rows, "draw": draw}


def throughput(model, tok, args: ScaleSettings) -> dict:
    """Largest batch under ``--kv-memory-gb`` per method and the total tokens/s it reaches."""
    prompt_len = len(tok.apply_chat_template([{"role": "user", "content": "x" * 10}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)) + 40
    rows = []
    for method in ["full", *names(args.methods)]:
        policy = make_policy(method, budget=None if method == "full" else args.budget)
        batch = min(args.max_batch, max_batch_size(model, policy, prompt_len, args.new_tokens, args.kv_memory_gb))
        if batch == 0:
            print(f"{method}: not even one row fits {args.kv_memory_gb} GiB")
            continue
        row = timed_generate(model, tok, method, args.budget, batch, args.new_tokens, kv_memory_gb=args.kv_memory_gb,
                             compile=args.compile)
        row["total_tokens_per_s"] = row["generated_tokens"] / row["wall_s"]  # prefill included
        rows.append(row)
        print(f"{method:12} max batch {batch:4d}  {row['decode_tokens_per_s']:8.1f} tok/s decoding, "
              f"{row['total_tokens_per_s']:8.1f} with prefill  peak KV {row['peak_kv_bytes'] / 2**30:.3f} GiB", flush=True)
    if not rows:
        raise ValueError(f"no method fits one row in {args.kv_memory_gb} GiB; raise --kv-memory-gb")
    full = next((r for r in rows if r["method"] == "full"), None)
    for r in rows:
        if full is None:  # no ratio without the reference (never against another method)
            r["throughput_vs_full"] = None
            continue
        r["throughput_vs_full"] = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        r["total_vs_full"] = r["total_tokens_per_s"] / full["total_tokens_per_s"]
        print(f"{r['method']:12} {r['throughput_vs_full']:.2f}x full's max-batch decode throughput, "
              f"{r['total_vs_full']:.2f}x with prefill")
    if full is None:
        print(f"full: no row fits {args.kv_memory_gb} GiB, so there is no ratio to report")

    def draw(ax):
        ax.bar([r["method"] for r in rows], [r["decode_tokens_per_s"] for r in rows])
        ax.set(ylabel="decode tokens/s at the largest batch", title=f"KV limit {args.kv_memory_gb} GiB")

    return {"rows": rows, "draw": draw}


def long(model, tok, args: ScaleSettings) -> dict:
    """Decode tokens/s of full vs bounded methods over long generations (batch ``--batch``).

    Each method generates once, to the longest of ``--lengths``; the clock read on the way gives
    its speed over the first L tokens for every L asked for (the mean over the whole run to L) and
    over the last stretch before L (the speed *at* that length), and the run's KV bytes trace
    shows the memory as it grows."""
    lengths = sorted(numbers(args.lengths))
    if any(n % CHECK_EVERY for n in lengths):
        raise ValueError(f"--lengths {lengths}: each must be a multiple of {CHECK_EVERY} (the decode loop's host check)")
    every = math.gcd(256, *lengths)
    runs = run_each(model, tok, args, lengths[-1], clock_every=every)  # runs[0] is full
    rows = []
    for length in lengths:
        at_length = [{"method": run["method"], "budget": run["budget"], "batch": run["batch"], "new_tokens": length,
                      "decode_tokens_per_s": tokens_per_s_between(run, 0, length),
                      "tokens_per_s_last_stretch": tokens_per_s_between(run, length - every, length),
                      "kv_bytes_at_length": max((b for s, b in run["kv_bytes_trace"] if s <= length), default=0)}
                     for run in runs]
        full = at_length[0]
        for row in at_length:
            for key, src in (("speed_vs_full", "decode_tokens_per_s"), ("last_stretch_vs_full", "tokens_per_s_last_stretch"),
                             ("kv_bytes_vs_full", "kv_bytes_at_length")):
                row[key] = row[src] / full[src]
            print(f"{length:6d} tokens {row['method']:10} {row['decode_tokens_per_s']:7.1f} tok/s "
                  f"({row['speed_vs_full']:.2f}x full), at {length}: {row['tokens_per_s_last_stretch']:7.1f} tok/s "
                  f"({row['last_stretch_vs_full']:.2f}x), KV {row['kv_bytes_at_length'] / 2**20:8.1f} MiB "
                  f"({row['kv_bytes_vs_full']:.3f}x)", flush=True)
        rows += at_length

    def draw(axes):
        speed, memory = axes
        for run in runs:
            ends = [n for n, _ in run["clock"] if n % every == 0 and n >= 2 * every]
            speed.plot(ends, [tokens_per_s_between(run, n - every, n) for n in ends], label=run["method"])
            trace = [*run["kv_bytes_trace"], (lengths[-1], run["kv_bytes_trace"][-1][1])]
            memory.step([s for s, _ in trace], [b / 2**20 for _, b in trace], where="post", label=run["method"])
        speed.set(xlabel="generated tokens", ylabel=f"decode tokens/s (all rows, per {every} tokens)",
                  title=f"{args.model}, batch {args.batch}, budget {args.budget}")
        memory.set(xlabel="generated tokens", ylabel="allocated KV (MiB)", title="KV memory")
        for ax in axes:
            ax.legend()

    return {"rows": rows, "runs": runs, "draw": draw, "panels": 2, "every": every}


RUNS = {"memory": memory, "throughput": throughput, "long": long}


def run(model, tok, args: ScaleSettings) -> dict:
    """Benchmark ``args.name`` on a loaded model; writes its JSON (``--out``) and PNG, returns its result."""
    with profiled(args.profile):
        result = RUNS[args.name](model, tok, args)
    out = write(args.out or f"benchmarks/results/{args.name}.json",
                {"benchmark": args.name, "model": args.model, "machine": machine(model),
                 "settings": asdict(args), "rows": result["rows"],
                 **({"runs": result["runs"]} if "runs" in result else {})})
    plot(out, result["draw"], result.get("panels", 1))
    return result
