"""Issue 35 item 4: the effect of the official last-partner exemption on rkv and skipkv.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/keysim_effect.py [--prompts 6] [--new-tokens 256]

1. Generation: the first ``--prompts`` GSM8K test questions, greedy, SmolLM2-135M, rkv and
   skipkv at budget 64, ``partner_threshold`` 0.5 (new default) vs None (kvsieve's earlier
   reading): rows whose tokens differ and where they first differ.
2. Kept sets, paired on the same cache: during each 0.5 run every compression also scores the
   layer with threshold None and with the official partnerless-row quirk (such a row zeroes its
   cosine to slot 0), and compares which unprotected tokens each would keep.
3. Time of one layer's redundancy at cap 600 (3 kv heads, head_dim 64: SmolLM2's), old vs new.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from kvsieve import GenerateConfig, generate
from kvsieve.allocators import make_allocator
from kvsieve.cache import DEAD_POS
from kvsieve.generate import encode_prompts
from kvsieve.methods._keysim import mean_similarity_to_others, softmax_similarity_mean, unit_keys
from kvsieve.methods.rkv import RKV
from kvsieve.methods.skipkv import SkipKV
from kvsieve.models import load_model
from kvsieve.policy import Policy

BUDGET = 64


def dense_redundancy(unit, live, threshold, mode, slot0_quirk):
    """[B, H, cap] redundancy from the whole S (small caps only): the official edit, optionally
    with its partnerless-row side effect (the row's cosine to slot 0 zeroed)."""
    B, H, cap, _ = unit.shape
    s = unit @ unit.transpose(-1, -2)  # [B, H, cap, cap]
    eye = torch.eye(cap, dtype=torch.bool)
    s.masked_fill_(eye, 0.0)
    partner = (s > threshold) & live[:, :, None, :] & live[:, :, :, None] & ~eye
    slots = torch.arange(cap)
    last = torch.where(partner, slots, -1).amax(-1, keepdim=True)  # [B, H, cap, 1]
    if slot0_quirk:
        last = torch.where(live[..., None] & (last < 0), 0, last)
    s.masked_fill_(slots == last, 0.0)
    n = live.sum(-1, keepdim=True)
    if mode == "rkv":
        mean = s.sum(2) / (n - 1).clamp(min=1)
        return mean.masked_fill(~live, float("-inf")).softmax(-1).nan_to_num(0.0)
    e = s.exp().masked_fill(eye | ~live[:, :, None, :], 0.0)  # eq5: row softmax over live j != i
    rows = e / e.sum(-1, keepdim=True).clamp(min=1e-30) * live[..., None]
    return rows.sum(2) / n.clamp(min=1) * live


class Probe:
    """Mixin for a scorer: at each compression also score the layer with the other variants and
    record the overlap of the unprotected kept sets (the run itself follows the real score)."""

    def setup(self, prompt_len: torch.Tensor, protect_prompt: bool, weight: float):
        self.prompt_len, self.protect_prompt, self.weight, self.records = prompt_len, protect_prompt, weight, []

    def redundancy_variants(self, layer, live):
        unit = unit_keys(layer.keys, live)
        mode = "rkv" if isinstance(self, RKV) or self.redundancy == "rkv" else "eq5"
        aggregate = (lambda t: mean_similarity_to_others(unit, live, t).masked_fill(~live, float("-inf"))
                     .softmax(-1).nan_to_num(0.0)) if mode == "rkv" else (
                     lambda t: softmax_similarity_mean(unit, live, threshold=t))
        return {"new": aggregate(self.partner_threshold), "old": aggregate(None),
                "quirk": dense_redundancy(unit, live, self.partner_threshold, mode, True)}

    def score(self, layer, seen_tokens):
        scores = super().score(layer, seen_tokens)
        live = layer.live()
        red = self.redundancy_variants(layer, live)
        # the scores differ only in the redundancy term: weight * R
        variants = {k: scores + self.weight * (red["new"] - r) for k, r in red.items()}
        pos = layer.meta["pos"]
        protected = (pos >= (seen_tokens - self.window)[:, None, None]) & live
        bound = torch.full_like(seen_tokens, BUDGET)
        if self.protect_prompt:  # rkv; with ignore_eos every row runs to the end, so rows stay 0..B-1
            protected |= pos < self.prompt_len[:, None, None]
            bound = bound + self.prompt_len
        candidates = live & ~protected
        unit = unit_keys(layer.keys, live)
        s = unit @ unit.transpose(-1, -2)
        s.diagonal(dim1=-2, dim2=-1).fill_(0.0)
        has_partner = ((s > self.partner_threshold) & live[:, :, None, :]).any(-1) & live
        B, H, _ = pos.shape
        for b in range(B):
            for h in range(H):
                k = int(bound[b]) - int(protected[b, h].sum())
                n = int(candidates[b, h].sum())
                if n <= k or k <= 0:
                    continue
                kept = {name: set(v[b, h].masked_fill(~candidates[b, h], float("-inf")).topk(k).indices.tolist())
                        for name, v in variants.items()}
                self.records.append({"k": k, "n": n, "cap": int(live[b, h].sum()),
                                     "same_old": len(kept["new"] & kept["old"]),
                                     "same_quirk": len(kept["new"] & kept["quirk"]),
                                     "partnered_rows": float(has_partner[b, h].sum() / live[b, h].sum())})
        return scores


@dataclasses.dataclass
class ProbeRKV(Probe, RKV):
    pass


@dataclasses.dataclass
class ProbeSkipKV(Probe, SkipKV):
    pass


def run(model, tok, prompts, method, threshold, new_tokens, probe):
    cls = {"rkv": ProbeRKV if probe else RKV, "skipkv": ProbeSkipKV if probe else SkipKV}[method]
    scorer = cls(partner_threshold=threshold)
    policy = Policy(scorer=scorer, budget=BUDGET, allocator=make_allocator("uniform"))
    config = GenerateConfig(max_new_tokens=new_tokens, ignore_eos=True)
    if probe:
        lengths = torch.tensor([len(ids) for ids in encode_prompts(tok, prompts, config)])
        weight = 1 - (scorer.mix_lambda if method == "rkv" else scorer.sigma)
        scorer.setup(lengths, policy.protect_prompt, weight)
    t0 = time.perf_counter()
    out = generate(model, tok, prompts, policy, config)
    return out, time.perf_counter() - t0, getattr(scorer, "records", None)


def timing(cap=600, batch=1, heads=3, dim=64, repeats=15):
    """Median ms of one layer's redundancy, old and new calls interleaved (the CPU is shared)."""
    torch.manual_seed(0)
    keys = torch.randn(batch, heads, cap, dim) + 0.8  # a shared direction, as real keys have: partners
    live = torch.ones(batch, heads, cap, dtype=torch.bool)
    unit = unit_keys(keys, live)
    cases = {"rkv old (None)": lambda: mean_similarity_to_others(unit, live, None),
             "rkv new (0.5)": lambda: mean_similarity_to_others(unit, live, 0.5),
             "skipkv eq5 old (None)": lambda: softmax_similarity_mean(unit, live),
             "skipkv eq5 new (0.5)": lambda: softmax_similarity_mean(unit, live, threshold=0.5)}
    times = {name: [] for name in cases}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: round(statistics.median(t[1:]) * 1e3, 2) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--timing-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"timing_ms_per_layer_cap600": {f"batch {b}": timing(batch=b) for b in (1, 8)}}
    print(json.dumps(report, indent=1), flush=True)
    if args.timing_only:
        return
    with open("../shared/data/gsm8k_test.jsonl") as f:
        prompts = [json.loads(line)["question"] for line in f][: args.prompts]
    model, tok = load_model("smollm2-135m")
    for method in ("rkv", "skipkv"):
        new, t_new, records = run(model, tok, prompts, method, 0.5, args.new_tokens, probe=True)
        old, t_old, _ = run(model, tok, prompts, method, None, args.new_tokens, probe=False)
        first_diff = []
        for a, b in zip(new.token_ids, old.token_ids):
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            first_diff.append(diff[0] if diff else None)
        kept = sum(r["k"] for r in records)
        if not records:
            raise SystemExit(f"{method}: no compression happened; raise --new-tokens")
        report[method] = {
            "rows_differing": sum(d is not None for d in first_diff), "rows": len(prompts),
            "first_differing_token": first_diff,
            "tokens_equal_fraction": sum(x == y for a, b in zip(new.token_ids, old.token_ids) for x, y in zip(a, b))
            / sum(len(a) for a in new.token_ids),
            "compressions_x_heads": len(records),
            "kept_overlap_new_vs_old": sum(r["same_old"] for r in records) / kept,
            "heads_with_kept_set_changed": sum(r["same_old"] < r["k"] for r in records) / len(records),
            "kept_overlap_new_vs_slot0_quirk": sum(r["same_quirk"] for r in records) / kept,
            "heads_changed_by_quirk": sum(r["same_quirk"] < r["k"] for r in records) / len(records),
            "live_rows_with_a_partner": statistics.mean(r["partnered_rows"] for r in records),
            "cap_range": [min(r["cap"] for r in records), max(r["cap"] for r in records)],
            "wall_s_new_probed_vs_old": [round(t_new, 1), round(t_old, 1)],
            "texts_new_old_row0": [new.texts[0][:160], old.texts[0][:160]],
        }
        print(json.dumps({method: report[method]}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
