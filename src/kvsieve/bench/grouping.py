"""What SkipKV's batch grouping by prefill length (Sec. 4.3, Eq. 12) changes in kvsieve.

SkipKV sorts prompts by prefill length before cutting batches, because in its engine the
left padding of a batch counts against the KV budget (Eq. 12, B' = B - padding).  kvsieve
drops padding after prefill (dead slots, never live), so the budget of every row is its own
whatever the batch.  This benchmark runs the same prompts twice, batches cut in data-set
order and batches cut after sorting by prompt length, and reports in one run:

* padding tokens (Eq. 12's sum of Delta_pad) and prefill time, which grouping does reduce;
* peak live KV tokens per row, which it must not change (padding is never live);
* decode tokens/s, and the share of rows whose greedy output is token-for-token the same
  (batched float sums can flip a near-tie; nothing else differs).

    kvsieve bench grouping --model smollm2-135m --method skipkv --budget 96 --samples 16 --batch 4
"""

from __future__ import annotations

import time
from dataclasses import asdict

from ..data import load_dataset
from ..generate import GenerateConfig, encode_prompts, generate
from ..methods import make_policy
from ..data.batching import group_by_prefill_length, padding_tokens
from .common import machine, profiled, write
from .settings import GroupingSettings


def run_batches(model, tok, prompts, batches, method: str, budget: int, config: GenerateConfig) -> dict:
    """Generate each batch of prompt indices; per-prompt tokens and stats in prompt order."""
    tokens, stats = [None] * len(prompts), [None] * len(prompts)
    prefill_s = decode_s = 0.0
    start = time.perf_counter()
    for batch in batches:
        result = generate(model, tok, [prompts[i] for i in batch], make_policy(method, budget=budget), config)
        for i, ids, stat in zip(batch, result.token_ids, result.stats):
            tokens[i], stats[i] = ids, stat
        prefill_s += max(s.prefill_s for s in result.stats)  # rows of a batch share one prefill
        decode_s += max(s.decode_s for s in result.stats)
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s, "wall_s": time.perf_counter() - start,
            "decode_tokens_per_s": generated / decode_s if decode_s else 0.0,
            "peak_kv_tokens": [max(s.peak_kv_tokens) for s in stats],
            "compression_events": [s.compression_events for s in stats]}


def measure(model, tok, args: GroupingSettings) -> dict:
    samples = load_dataset(args.dataset, args.data, limit=args.samples)
    prompts = [s.messages for s in samples]
    config = GenerateConfig(max_new_tokens=args.new_tokens, compile=args.compile)
    lengths = [len(ids) for ids in encode_prompts(tok, prompts, config)]
    orders = {"data-set order": [list(range(i, min(i + args.batch, len(prompts))))
                                 for i in range(0, len(prompts), args.batch)],
              "grouped by length": group_by_prefill_length(lengths, args.batch)}
    runs = {}
    for name, batches in orders.items():
        runs[name] = run_batches(model, tok, prompts, batches, args.method, args.budget, config)
        runs[name]["padding_tokens"] = padding_tokens(lengths, batches)
    plain, grouped = runs.values()
    same = sum(a == b for a, b in zip(plain["tokens"], grouped["tokens"]))
    print(f"{args.method} at budget {args.budget}, {len(prompts)} {args.dataset} prompts, batch {args.batch}, "
          f"{args.new_tokens} new tokens")
    print(f"{'':20} {'padding':>8} {'prefill s':>10} {'decode tok/s':>13} {'max peak KV/row':>16}")
    for name, r in runs.items():
        print(f"{name:20} {r['padding_tokens']:8d} {r['prefill_s']:10.2f} {r['decode_tokens_per_s']:13.1f} "
              f"{max(r['peak_kv_tokens']):16d}")
    same_peak = sum(a == b for a, b in zip(plain["peak_kv_tokens"], grouped["peak_kv_tokens"]))
    print(f"rows with identical output: {same}/{len(prompts)}; with identical peak live KV tokens: "
          f"{same_peak}/{len(prompts)}; prefill time grouped/plain {grouped['prefill_s'] / plain['prefill_s']:.2f}x")
    rows = [{"order": name, **{k: v for k, v in r.items() if k != "tokens"}} for name, r in runs.items()]
    return {"rows": rows, "identical_outputs": same, "identical_peaks": same_peak, "prompts": len(prompts),
            "prompt_lengths": lengths}


def run(model, tok, args: GroupingSettings) -> dict:
    """Both orders of the same prompts; prints the comparison and writes its JSON."""
    with profiled(args.profile):
        result = measure(model, tok, args)
    write(args.out, {"benchmark": "grouping", "model": args.model, "machine": machine(model),
                     "settings": asdict(args), **result})
    return result
