"""Bounded caches at scale: memory vs generated length, throughput under a KV memory limit,
and long generation. Each figure is a ratio to ``full`` measured in the same run.

    kvsieve bench memory     --new-tokens 8192 --budget 256 --methods tova,lazy,streaming
    kvsieve bench throughput --kv-memory-gb 0.25 --new-tokens 512 --budget 128 --methods tova,streaming
    kvsieve bench long       --lengths 4096,8192 --budget 512 --methods tova,lazy
"""

from __future__ import annotations

import argparse

from ..memory import max_batch_size
from ..methods import make_policy
from .common import add_model_args, load_for, machine, plot, profiled, timed_generate, write


def memory(model, tok, args) -> dict:
    """Peak allocated KV bytes as one row generates ``new_tokens``: full grows, bounded stays flat."""
    rows = [timed_generate(model, tok, m, args.budget, 1, args.new_tokens) for m in ["full", *args.methods]]
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


def throughput(model, tok, args) -> dict:
    """Largest batch under ``--kv-memory-gb`` per method and the total tokens/s it reaches."""
    prompt_len = len(tok.apply_chat_template([{"role": "user", "content": "x" * 10}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)) + 40
    rows = []
    for method in ["full", *args.methods]:
        policy = make_policy(method, budget=None if method == "full" else args.budget)
        batch = min(args.max_batch, max_batch_size(model, policy, prompt_len, args.new_tokens, args.kv_memory_gb))
        if batch == 0:
            print(f"{method}: not even one row fits {args.kv_memory_gb} GB")
            continue
        row = timed_generate(model, tok, method, args.budget, batch, args.new_tokens, kv_memory_gb=args.kv_memory_gb)
        rows.append(row)
        print(f"{method:12} max batch {batch:4d}  {row['decode_tokens_per_s']:8.1f} tok/s  "
              f"peak KV {row['peak_kv_bytes'] / 2**30:.3f} GB", flush=True)
    full = rows[0]
    for r in rows:
        r["throughput_vs_full"] = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        print(f"{r['method']:12} {r['throughput_vs_full']:.2f}x full's max-batch throughput")

    def draw(ax):
        ax.bar([r["method"] for r in rows], [r["decode_tokens_per_s"] for r in rows])
        ax.set(ylabel="total tokens/s at the largest batch", title=f"KV limit {args.kv_memory_gb} GB")

    return {"rows": rows, "draw": draw}


def long(model, tok, args) -> dict:
    """tokens/s of full vs bounded methods over long generations (batch ``--batch``)."""
    rows = []
    for length in args.lengths:
        full = None
        for method in ["full", *args.methods]:
            r = timed_generate(model, tok, method, args.budget, args.batch, length)
            full = full or r
            r["speed_vs_full"] = r["decode_tokens_per_s"] / full["decode_tokens_per_s"]
            rows.append(r)
            print(f"{length:6d} tokens {method:12} {r['decode_tokens_per_s']:8.1f} tok/s "
                  f"{r['speed_vs_full']:.2f}x full, peak KV {r['peak_kv_bytes']:,} B", flush=True)

    def draw(ax):
        for method in ["full", *args.methods]:
            pts = [(r["new_tokens"], r["decode_tokens_per_s"]) for r in rows if r["method"] == method]
            ax.plot(*zip(*pts), marker="o", label=method)
        ax.set(xlabel="generated tokens", ylabel="decode tokens/s", title=f"batch {args.batch}, budget {args.budget}")
        ax.legend()

    return {"rows": rows, "draw": draw}


RUNS = {"memory": memory, "throughput": throughput, "long": long}


def main(argv=None, name: str | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    if name is None:
        ap.add_argument("name", choices=sorted(RUNS))
    add_model_args(ap)
    ap.add_argument("--methods", default="tova,streaming", type=lambda s: [m for m in s.split(",") if m])
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=2048)
    ap.add_argument("--lengths", default=[4096, 8192], type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-memory-gb", type=float, default=0.25)
    ap.add_argument("--max-batch", type=int, default=64, help="cap on the admitted batch (CPU time)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    name = name or args.name
    model, tok = load_for(args)
    with profiled(args.profile):
        result = RUNS[name](model, tok, args)
    out = write(args.out or f"benchmarks/results/{name}.json",
                {"benchmark": name, "model": args.model, "machine": machine(model),
                 "settings": {k: v for k, v in vars(args).items() if k != "name"}, "rows": result["rows"]})
    plot(out, result["draw"])


if __name__ == "__main__":
    main()
