"""Engine benchmark: tokens/s and peak KV bytes of bounded caches vs the full cache.

For each batch size, every method decodes the same prompts for ``--new-tokens`` tokens
(EOS ignored, greedy) after one short warm-up; the methods run in an interleaved order over
``--repeats`` rounds and the best round counts, so drift on a shared machine hits all methods
alike. Ratios are against ``full`` measured in the same run.

    kvsieve bench engine --model smollm2-135m --new-tokens 1024 --batches 1,4 --budget 128
"""

from __future__ import annotations

from .common import machine, profiled, report, timed_generate
from .settings import EngineSettings, numbers, with_full


def run(model, tok, args: EngineSettings) -> list[dict]:
    """Every method (``full`` first, always) at every batch size; prints the table, writes JSON and PNG."""
    methods = with_full(args.methods)
    timed_generate(model, tok, "full", args.budget, 1, 8)  # warm-up
    with profiled(args.profile):
        rows = [row for batch in numbers(args.batches) for row in measure(model, tok, methods, batch, args)]
    header = (f"{'batch':>5} {'method':10} {'tok/s':>8} {'x full':>7} {'peak KV bytes':>15} {'x full':>7} "
              f"{'compressions':>12}")
    report(args, "engine", machine(model), rows, header,
           lambda r: (f"{r['batch']:>5} {r['method']:10} {r['decode_tokens_per_s']:8.1f} {r['speed_vs_full']:7.2f} "
                      f"{r['peak_kv_bytes']:15,} {r['kv_bytes_vs_full']:7.3f} {r['compression_events']:12}"), draw)
    return rows


def draw(ax, rows: list[dict]) -> None:
    """Tokens/s and peak KV bytes of each method relative to full, per batch size."""
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / (2 * len(batches))
    for i, batch in enumerate(batches):
        by_method = {r["method"]: r for r in rows if r["batch"] == batch}
        for k, (key, what) in enumerate((("speed_vs_full", "tokens/s"), ("kv_bytes_vs_full", "peak KV bytes"))):
            offset = (2 * i + k) * width
            ax.bar([j + offset for j in range(len(methods))], [by_method[m][key] for m in methods], width=width,
                   label=f"{what}, batch {batch}", hatch="//" if k else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(methods))], methods)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("ratio to full (same run)")
    ax.legend(fontsize=7)


def measure(model, tok, methods: list[str], batch: int, args: EngineSettings) -> list[dict]:
    """Best of ``--repeats`` interleaved rounds per method at one batch size, with ratios to full."""
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for method in methods:
            row = timed_generate(model, tok, method, args.budget, batch, args.new_tokens, compile=args.compile)
            if method not in best or row["decode_tokens_per_s"] > best[method]["decode_tokens_per_s"]:
                best[method] = row
            print(f"  batch {batch} {method:10s} {row['decode_tokens_per_s']:8.1f} tok/s", flush=True)
    for row in best.values():
        row["speed_vs_full"] = row["decode_tokens_per_s"] / best["full"]["decode_tokens_per_s"]
        row["kv_bytes_vs_full"] = row["peak_kv_bytes"] / best["full"]["peak_kv_bytes"]
    return [best[m] for m in methods]

