#!/usr/bin/env python3
"""Does the amount of calibration text change TriAttention's key ranking?  (issue 51, "Calibration")

TriAttention's statistics (``kvsieve calibrate triattention``) are the pre-RoPE query centre
E[q_f] and mean norm E|q_f| of every (layer, query head).  kvsieve calibrates on 4,096 tokens by
default; the official calibration (scripts/calibrate.py of the TriAttention repository) runs one
forward pass over up to 32,768 tokens.  This script compares statistics files made with
different token counts (or chunkings, or data slices) where it matters: the order in which the
real TriAttention scorer (``kvsieve.methods.triattention.TriAttention.score``) ranks the keys of
real caches.

What it does:

1. Statistics.  Each ``--calibrate TOKENS[:CHUNK[:SKIP]]`` runs kvsieve's calibration
   (``kvsieve.analysis.qk.calibrate``) on ``--data`` with TOKENS tokens cut into chunks of CHUNK
   (default 1024; CHUNK = TOKENS is one pass), starting SKIP rows into the data (default 0: a
   SKIP gives a disjoint sample, the noise floor of a token count), and saves the file in
   ``--out-dir``.  Each ``--stats FILE`` adds an existing file.  The reference is the file with
   the most tokens (``--reference LABEL``, repeatable, to choose); every other file is compared with each.
2. Caches.  ``--caches`` caches are built from disjoint runs of rows of ``--eval-data`` (GSM8K
   test by default, rows joined by blank lines): ``--context`` tokens of text, then ``--generate``
   greedy tokens of the model's own continuation; one forward pass over the whole sequence gives
   each layer's post-RoPE keys, stored in a ``SieveCache`` as generation would store them.
3. Scores.  For every statistics file, ``TriAttention(stats=FILE, pruning=...)`` scores every
   layer at the cache's next position (z-normalised per query head, max over the query group:
   the method's own ``score``).  Every token of the cache competes (the official runner's
   setting: prompt inside the budget, no protected window).
4. Figures, per (layer, kv head), averaged over the caches: the Spearman rank correlation of the
   two files' scores, and the overlap of the kept sets at each budget B (|top-B(a) & top-B(b)| / B,
   the share of the B kept tokens both files keep).  And per layer, the relative difference of the
   statistics themselves: ||q_mean_a - q_mean_ref|| / ||q_mean_ref|| (over the layer's query heads,
   frequency pairs and real/imaginary parts) and the same for q_abs_mean.

Example (the run of docs/triattention-calibration.md):

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/triattention_calibration_size.py \\
        --calibrate 4096 --calibrate 4096:1024:2000 --calibrate 16384 --calibrate 32768 \\
        --out-dir results/triattention-calibration --json results/triattention-calibration/ranking.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "gsm8k_train.jsonl"
DEFAULT_EVAL = REPO.parent / "shared" / "data" / "gsm8k_test.jsonl"


class UsageError(ValueError):
    """A bad argument or input file: printed as ``error: ...`` with exit status 2."""


@dataclass
class Entry:
    label: str
    path: Path
    tokens: int
    chunk: int | None
    skip: int
    seconds: float | None = None  # calibration time, when calibrated here


def parse_spec(spec: str) -> tuple[int, int, int]:
    """TOKENS[:CHUNK[:SKIP]] -> (tokens, chunk, skip)."""
    parts = spec.split(":")
    try:
        if not 1 <= len(parts) <= 3:
            raise ValueError
        values = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--calibrate {spec!r}: expected TOKENS[:CHUNK[:SKIP]] (integers), e.g. 32768 or "
                         "8192:8192 or 4096:1024:2000") from None
    tokens, chunk, skip = values[0], values[1] if len(values) > 1 else 1024, values[2] if len(values) > 2 else 0
    if tokens < 2 or chunk < 2 or skip < 0:
        raise UsageError(f"--calibrate {spec!r}: TOKENS and CHUNK must be >= 2 and SKIP >= 0")
    return tokens, chunk, skip


def label_of(tokens: int, chunk: int | None, skip: int) -> str:
    label = f"{tokens}" + ("" if chunk is None else f"/c{chunk}")
    return label + (f"/skip{skip}" if skip else "")


def calibrate_entries(specs, model, tokenizer, data: Path, out_dir: Path, model_tag: str) -> list[Entry]:
    from kvsieve.analysis.qk import calibrate, read_texts

    if not specs:
        return []
    texts = read_texts(data)
    entries = []
    for spec in specs:
        tokens, chunk, skip = parse_spec(spec)
        if skip >= len(texts):
            raise UsageError(f"--calibrate {spec}: SKIP {skip} >= the {len(texts)} rows of {data}")
        start = time.perf_counter()
        stats = calibrate(model, tokenizer, texts[skip:], tokens=tokens, chunk=chunk, data=str(data))
        seconds = time.perf_counter() - start
        stats.settings["skip_rows"] = skip
        fed = stats.settings["tokens"]
        if fed < tokens:
            print(f"note: {data} from row {skip} holds only {fed:,} tokens; calibrated on those", file=sys.stderr)
        path = out_dir / (f"{model_tag}-t{fed}-c{chunk}" + (f"-skip{skip}" if skip else "") + ".pt")
        stats.save(path)
        print(f"calibrated {fed:,} tokens (chunks of {chunk}, from row {skip}) in {seconds:.1f} s -> {path}",
              file=sys.stderr)
        entries.append(Entry(label_of(fed, chunk, skip), path, fed, chunk, skip, seconds))
    return entries


def file_entries(paths) -> list[Entry]:
    from kvsieve.methods.triattention import QueryStats

    entries = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"--stats {path}: no such file (make one with kvsieve calibrate triattention)")
        settings = QueryStats.read(path).settings
        tokens, chunk, skip = int(settings.get("tokens", 0)), settings.get("chunk"), int(settings.get("skip_rows", 0))
        entries.append(Entry(label_of(tokens, chunk, skip), path, tokens, chunk, skip))
    return entries


def eval_caches(model, tokenizer, eval_data: Path, count: int, context: int, generate: int) -> list[torch.Tensor]:
    """``count`` token sequences [T]: ``context`` tokens of disjoint runs of rows, then ``generate`` greedy tokens."""
    from kvsieve.analysis.qk import read_texts

    texts = read_texts(eval_data)
    device = next(model.parameters()).device
    sequences, row = [], 0
    for _ in range(count):
        pieces, length = [], 0
        while length < context:
            if row >= len(texts):
                raise UsageError(f"{eval_data} has too few rows for {count} caches of {context} tokens")
            pieces.append(texts[row])
            row += 1
            length = len(tokenizer("\n\n".join(pieces)).input_ids)
        ids = tokenizer("\n\n".join(pieces) + "\n\n", return_tensors="pt").input_ids[0, -context:]
        if generate:
            with torch.inference_mode():
                out = model.generate(ids[None].to(device), max_new_tokens=generate, min_new_tokens=generate,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id)
            ids = out[0].cpu()
        sequences.append(ids)
    return sequences


@torch.inference_mode()
def cache_keys(model, ids: torch.Tensor):
    """A ``SieveCache`` holding every layer's post-RoPE keys of one forward pass over ``ids`` [T]."""
    from transformers import DynamicCache

    from kvsieve.cache import SieveCache

    device = next(model.parameters()).device
    hf = DynamicCache(config=model.config)
    model(ids[None].to(device), cache=hf, use_cache=True)
    layers = model.config.num_hidden_layers
    cache = SieveCache(layers)
    cache.begin_step(torch.arange(ids.numel(), device=device)[None])
    for index in range(layers):
        layer = hf.layers[index]
        cache.update(layer.keys, layer.values, index)
    return cache


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks along the last dimension (0 = lowest), float64."""
    return x.argsort(dim=-1).argsort(dim=-1).double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation along the last dimension (no ties expected in real-valued scores)."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(dim=-1, keepdim=True), rb - rb.mean(dim=-1, keepdim=True)
    return (ra * rb).sum(dim=-1) / (ra.square().sum(dim=-1) * rb.square().sum(dim=-1)).sqrt()


def overlap(a: torch.Tensor, b: torch.Tensor, budget: int) -> torch.Tensor:
    """|top-B(a) & top-B(b)| / B along the last dimension."""
    top_a = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(budget, dim=-1).indices, True)
    top_b = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, b.topk(budget, dim=-1).indices, True)
    return (top_a & top_b).sum(dim=-1).double() / budget


def layer_scores(scorer, cache, tokens: int) -> torch.Tensor:
    """[L, H_kv, T] TriAttention scores of every layer's keys at the next position ``tokens``."""
    from kvsieve.cache import DEAD_POS

    out = []
    seen = torch.tensor([tokens], device=cache.layers[0].keys.device)
    for layer in cache.layers:
        live = layer.meta["pos"][0] != DEAD_POS  # [H, cap]
        if not bool(live[:, :tokens].all()) or bool(live[:, tokens:].any()):
            raise RuntimeError("the cache's live slots are not its first tokens")
        out.append(scorer.score(layer, seen)[0, :, :tokens].double().cpu())
    return torch.stack(out)


def relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[L] ||a - b|| / ||b|| per layer (over everything after the layer dimension)."""
    return (a - b).double().flatten(1).norm(dim=-1) / b.double().flatten(1).norm(dim=-1)


def stats_differences(entries: list[Entry], reference: Entry) -> dict:
    """Per compared label: per-layer relative difference of q_mean and q_abs_mean against the reference,
    and the same over the whole model."""
    from kvsieve.methods.triattention import QueryStats

    ref = QueryStats.read(reference.path)
    out = {}
    for entry in entries:
        if entry is reference:
            continue
        st = QueryStats.read(entry.path)
        if st.q_mean.shape != ref.q_mean.shape:
            raise UsageError(f"{entry.path} and {reference.path} have different shapes: not the same model")
        out[entry.label] = {
            "q_mean_layer": relative(st.q_mean, ref.q_mean).tolist(),
            "q_abs_mean_layer": relative(st.q_abs_mean, ref.q_abs_mean).tolist(),
            "q_mean_all": float((st.q_mean - ref.q_mean).double().norm() / ref.q_mean.double().norm()),
            "q_abs_mean_all": float((st.q_abs_mean - ref.q_abs_mean).double().norm() / ref.q_abs_mean.double().norm()),
        }
    return out


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Compare TriAttention statistics of different calibration sizes by the key rankings they give "
                    "on real caches (issue 51). Prints markdown tables; --json writes every figure.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="bundled name, local directory or hub id")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="calibration text (JSONL or plain text)")
    parser.add_argument("--calibrate", action="append", default=[], metavar="TOKENS[:CHUNK[:SKIP]]",
                        help="calibrate here: TOKENS tokens in chunks of CHUNK (default 1024; CHUNK=TOKENS is one "
                             "pass) from row SKIP of --data (default 0); repeatable")
    parser.add_argument("--stats", action="append", default=[], type=Path, metavar="FILE",
                        help="an existing statistics file (kvsieve calibrate triattention); repeatable")
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "triattention-calibration",
                        help="where --calibrate writes its statistics files")
    parser.add_argument("--reference", action="append", default=[],
                        help="label of a reference file (as printed, e.g. 32768/c1024; repeatable: every file is "
                             "compared with each); default: the file with the most tokens")
    parser.add_argument("--eval-data", type=Path, default=DEFAULT_EVAL, help="text of the caches (JSONL or plain)")
    parser.add_argument("--caches", type=int, default=4, help="caches (disjoint runs of rows of --eval-data)")
    parser.add_argument("--context", type=int, default=1536, help="text tokens of each cache")
    parser.add_argument("--generate", type=int, default=256, help="greedy tokens generated after the text")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256], help="kept-set sizes")
    parser.add_argument("--pruning", default="per_layer_per_head", choices=["per_layer_per_head", "per_layer"],
                        help="TriAttention's pruning mode")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--per-head", action="store_true", help="also print the (layer, kv head) tables")
    parser.add_argument("--detail", action="append", default=[], metavar="LABEL",
                        help="per-layer and per-head tables only for these compared labels (repeatable; default all)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="print the tables of a saved --json result instead of computing")
    args = parser.parse_args(argv)

    try:
        if args.from_json:
            if not args.from_json.is_file():
                raise UsageError(f"--from-json {args.from_json}: no such file")
            try:
                result = json.loads(args.from_json.read_text(encoding="utf-8"))
                print(render(result, args.per_head, args.detail))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UsageError(f"--from-json {args.from_json}: not a result of this script ({err!r})") from None
            return 0
        return run(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def run(args) -> int:
    if len(args.calibrate) + len(args.stats) < 2:
        raise UsageError("need at least two statistics: give --calibrate and/or --stats twice or more")
    if args.caches < 1 or args.context < 2 or args.generate < 0:
        raise UsageError("--caches must be >= 1, --context >= 2 and --generate >= 0")
    if any(b < 1 for b in args.budgets):
        raise UsageError("--budgets must be >= 1")
    if max(args.budgets) >= args.context + args.generate:
        raise UsageError(f"the largest budget {max(args.budgets)} keeps the whole cache of "
                         f"{args.context + args.generate} tokens: lower --budgets or raise --context")
    for path, what in ((args.data, "--data"), (args.eval_data, "--eval-data")):
        if not Path(path).is_file():
            raise UsageError(f"{what} {path}: no such file")

    from kvsieve import models
    from kvsieve.methods.triattention import StatsModelError, TriAttention

    entries = file_entries(args.stats)  # checked before the (slow) model load
    try:
        model, tokenizer = models.load_model(args.model, device=args.device, dtype=args.dtype)
    except (ValueError, models.ModelNotInstalledError, OSError) as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tag = Path(args.model).name.replace(":", "-")
    try:
        entries += calibrate_entries(args.calibrate, model, tokenizer, args.data, args.out_dir, tag)
    except ValueError as err:
        raise UsageError(str(err)) from None
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise UsageError(f"two statistics files share a label ({labels}): give each setting once")
    if not args.reference:
        references = [max(entries, key=lambda e: e.tokens)]
    else:
        references = []
        for label in args.reference:
            matches = [e for e in entries if e.label == label]
            if not matches:
                raise UsageError(f"--reference {label}: no such label; labels: {labels}")
            references.append(matches[0])

    scorers = {}
    for entry in entries:
        scorer = TriAttention(stats=str(entry.path), pruning=args.pruning)
        try:
            scorer._stats.check(model, entry.path)
        except StatsModelError as err:
            raise UsageError(str(err)) from None
        scorers[entry.label] = scorer

    start = time.perf_counter()
    sequences = eval_caches(model, tokenizer, args.eval_data, args.caches, args.context, args.generate)
    pairs = [(e.label, r.label) for r in references for e in entries if e is not r]
    rho = {pair: [] for pair in pairs}
    over = {pair: {b: [] for b in args.budgets} for pair in pairs}
    for ids in sequences:
        cache = cache_keys(model, ids)
        scores = {label: layer_scores(s, cache, ids.numel()) for label, s in scorers.items()}
        for a, r in pairs:
            rho[a, r].append(spearman(scores[a], scores[r]))
            for b in args.budgets:
                over[a, r][b].append(overlap(scores[a], scores[r], b))
    result = {
        "model": args.model, "trained_context": getattr(model.config, "max_position_embeddings", None),
        "pruning": args.pruning, "eval_data": str(args.eval_data), "caches": len(sequences),
        "context": args.context, "generate": args.generate, "cache_tokens": [int(s.numel()) for s in sequences],
        "cache_seconds": time.perf_counter() - start, "budgets": args.budgets,
        "statistics": [{"label": e.label, "file": e.path.name, "tokens": e.tokens, "chunk": e.chunk,
                        "skip_rows": e.skip, "seconds": e.seconds} for e in entries],
        "references": [{
            "reference": r.label,
            "stats_difference": stats_differences(entries, r),
            # [L][H_kv] means over the caches, per compared label
            "spearman": {a: torch.stack(rho[a, r.label]).mean(dim=0).tolist() for a, rr in pairs if rr == r.label},
            "overlap": {a: {str(b): torch.stack(over[a, r.label][b]).mean(dim=0).tolist() for b in args.budgets}
                        for a, rr in pairs if rr == r.label},
        } for r in references],
    }
    print(render(result, args.per_head, args.detail))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


def render(result: dict, per_head: bool = False, detail: list[str] | None = None) -> str:
    """The markdown tables of a result (``run``'s, or one read back with --from-json)."""
    budgets = result["budgets"]
    cache_tokens = result["cache_tokens"]
    out = [f"model {result['model']} (trained context {result['trained_context']} tokens); {result['caches']} caches "
           f"of {result['context']} tokens of {Path(result['eval_data']).name} + {result['generate']} generated "
           f"({min(cache_tokens)}-{max(cache_tokens)} tokens); pruning {result['pruning']}; every token competes; "
           f"figures are means over the caches (caches and scores: {result['cache_seconds']:.0f} s)\n"]
    out.append(md_table(["statistics", "file", "tokens", "chunk", "skip rows", "calibration s"],
                        [[s["label"], s["file"], f"{s['tokens']}", f"{s['chunk']}", f"{s['skip_rows']}",
                          "-" if s["seconds"] is None else f"{s['seconds']:.0f}"] for s in result["statistics"]]))
    for block in result["references"]:
        ref, diffs = block["reference"], block["stats_difference"]
        rho = {k: torch.tensor(v) for k, v in block["spearman"].items()}
        over = {k: {int(b): torch.tensor(v) for b, v in d.items()} for k, d in block["overlap"].items()}
        others = list(rho)
        L, H = next(iter(rho.values())).shape
        out.append(f"\n### against {ref}\n")
        summary = []
        for a in others:
            r = rho[a].flatten()
            row = [f"{a} vs {ref}", f"{diffs[a]['q_mean_all']:.4f}", f"{diffs[a]['q_abs_mean_all']:.4f}",
                   f"{r.mean():.4f}", f"{r.min():.4f}"]
            for b in budgets:
                o = over[a][b].flatten()
                row += [f"{o.mean():.3f}", f"{o.min():.3f}"]
            summary.append(row)
        header = ["comparison", "rel. diff q_mean", "rel. diff q_abs_mean", "Spearman mean", "min"]
        for b in budgets:
            header += [f"overlap@{b} mean", "min"]
        out.append(md_table(header, summary))
        out.append(f"\n(Spearman and overlaps over the model's {L * H} (layer, kv head) pairs)")
        shown = [a for a in others if not detail or a in detail]
        if not shown:
            continue
        layer_rows = []
        for l in range(L):
            row = [f"{l}"]
            for a in shown:
                row += [f"{diffs[a]['q_mean_layer'][l]:.4f}", f"{diffs[a]['q_abs_mean_layer'][l]:.4f}",
                        f"{rho[a][l].min():.4f}", f"{over[a][min(budgets)][l].min():.3f}"]
            layer_rows.append(row)
        header = ["layer"]
        for a in shown:
            header += [f"{a}: rel. q_mean", "rel. q_abs_mean", "min Spearman", f"min overlap@{min(budgets)}"]
        out.append(f"\nper layer, against {ref} (relative differences over the layer's query heads; min over its "
                   "kv heads):\n")
        out.append(md_table(header, layer_rows))
        if per_head:
            head_rows = []
            for l in range(L):
                for h in range(H):
                    row = [f"{l}", f"{h}"]
                    for a in shown:
                        row += [f"{rho[a][l, h]:.4f}"] + [f"{over[a][b][l, h]:.3f}" for b in budgets]
                    head_rows.append(row)
            header = ["layer", "kv head"]
            for a in shown:
                header += [f"{a}: Spearman"] + [f"overlap@{b}" for b in budgets]
            out.append(f"\nper (layer, kv head), against {ref}:\n")
            out.append(md_table(header, head_rows))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
