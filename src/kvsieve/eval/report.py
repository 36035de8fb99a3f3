"""Summaries of a results directory: one line per (method, budget) cell, as CSV, markdown and a rich table.

Definitions (every number is computed from the rows alone):

* accuracy: share of correct samples, with a 95% Wilson score interval (Wilson 1927), which
  stays inside [0, 1] and is sensible for small n and accuracies near 0 or 1;
* retained: the cell's accuracy over ``full``'s accuracy on the *same* sample ids;
* vs full: on those same ids, ``-lost/+gained``, the samples ``full`` got right and the cell
  wrong and the reverse, with the exact two-sided McNemar p-value (McNemar 1947; under "no
  difference" the discordant samples split as Binomial(lost + gained, 1/2)): a small p says the
  cell's accuracy differs from ``full``'s beyond chance on these samples;
* Holm: each p-value adjusted for the other comparisons of its family by Holm's step-down method
  (Holm 1979: the k-th smallest of m p-values times m - k + 1, made non-decreasing, capped at 1),
  which bounds the chance of any false "beyond chance" in the family at 5% without assuming the
  tests independent.  The families: the vs-full column, the vs-random column, and the table of
  every two cells; a difference is called beyond chance when its Holm p is below 0.05;
* Δ vs full: the cell's accuracy minus ``full``'s on the same samples, in points, with a 95%
  interval for that paired difference by Newcombe's hybrid score method (Newcombe 1998, Stat.
  Med. 17:2635, method 10: Wilson intervals of the two accuracies combined with the correlation
  of the pairs), which stays inside [-100, 100] and agrees with the exact McNemar test far better
  than the Wald interval when few samples are discordant;
* vs random: the same pairing against the ``random`` cell at the same budget (the control: a
  method that cannot beat random eviction beyond chance has not shown that its scores help);
* every two cells, paired (the table under the summary, for grids of up to 20 graded cells):
  the same pairing for each pair of cells, on the samples both graded, with its raw and its Holm
  p (over all the table's pairs): with many pairs a lone raw p near 0.05 is weak evidence (under
  no difference about 5% of pairs fall below it by chance);
* effective budget: the live tokens per kv head the budget lets a cell keep after a compression,
  prompt included: the budget when the prompt competes for it, the budget plus the row's prompt
  tokens when the prompt is kept (the bound below), mean over rows; "-" without a budget.
  Between compressions a cache grows by up to its interval, which peak live/head shows: compare
  cells by accuracy against peak KV memory first, and read the nominal budget through this one;
* prompt: "kept" when the rows protect the prompt (``protect_prompt``: the budget bounds the
  generated tokens only), "pinned" when the prompt stays inside the budget (``pin_prompt``: the
  output gets what the prompt leaves), "competes" when prompt and output share the budget, "-"
  without one;
* KV compression: per sample, the KV tokens a full cache would hold at the end
  (``(prompt + generated) * kv_heads``) over the live KV tokens the method holds at the end
  (mean over layers, ``final_kv_tokens_mean``; rows written before that field existed use the
  largest layer, which understates methods whose layers differ), averaged over samples;
  ``full`` is 1x (the peak, usually right after prefill, shows in the memory column instead);
* peak KV: allocated cache bytes at the peak (K, V and per-token metadata; a batch's bytes are
  shared equally by its rows), mean over samples;
* at cap: rows that stopped at ``max_new_tokens`` (``finish_reason`` "length") rather than at
  EOS or a stop string: a cell where most rows do has lost the end of its answers (a model that
  answers and then writes on), "-" for rows that recorded no finish reason;
* tokens/s: the cell's generated tokens over its batches' decode time (each batch until its
  last row ends; ``batch_tokens_per_s``): what the machine produced, not one row's share.
* peak live/head: the most live KV tokens any layer held at once, per kv head (the row's
  ``peak_kv_tokens`` is summed over kv heads), mean over samples; it includes the prefill
  transient: a prompt longer than the budget is held whole until its first compression;
* steady/head: the same after the first compression (``steady_peak_kv_tokens``), mean over the
  samples that compressed: the peak the budget bounds;
* bound: whether a budget held as a bound in the steady state.  A row is over when its peak live
  tokens per kv head after its first compression exceed 1.5 x its bound: the budget, or budget +
  prompt tokens for a row whose settings protect the prompt (``protect_prompt``); 1.5 x is the
  most the default schedule allows (interval capped at budget // 2).  Rows written before rows
  carried the steady peak are judged on their whole peak.  "OVER k/n" counts rows over; "ok";
  "unknown" when rows lack ``kv_heads`` (written before rows carried it) and none is known to be
  over; "-" for a cell without a budget.  "(prefill k/n)" after it counts the rows whose prefill
  transient alone went over: the prompt, held before the first compression, not an overflow.
* events: compression events per sample (mean), and the share of samples that compressed at
  least once; a bounded cell where no sample compressed is marked "never compressed".
* perplexity (``text`` data set): exp(total NLL / total scored tokens) over the cell's chunks.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..files import check_writable, write_atomic
from .store import load_results, read_manifest

Z95 = 1.959964  # two-sided 95% normal quantile


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``correct / n``, always holding ``correct / n``.

    In exact arithmetic the interval holds the estimate and ends at 0 for 0 correct (at 1 for all
    correct); in floating point ``centre - half`` can come out a few 1e-17 above 0 (0/3, 0/5, 0/6)
    and ``centre + half`` just below 1 (4/4, 10/10), which made the plots' error bars negative.
    Each bound is therefore kept on its side of the estimate."""
    if n == 0:
        return (math.nan, math.nan)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value from the discordant pair counts: 2 P(X <= min), X ~ Bin(n, 1/2)."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment (Holm 1979) of a family of p-values, in their order: the k-th
    smallest of m (k from 1) becomes max over j <= k of min(1, (m - j + 1) p_(j))."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def paired_difference_interval(pairs: list[tuple[bool, bool]], z: float = Z95) -> tuple[float, float, float]:
    """``(difference, low, high)`` of the second member's accuracy minus the first's over ``pairs``
    ((reference correct, cell correct), as ``shared_pairs`` gives them), with Newcombe's hybrid
    score interval for paired proportions (Newcombe 1998, Stat. Med. 17:2635, method 10)."""
    n = len(pairs)
    both = sum(f and c for f, c in pairs)
    gained = sum(c and not f for f, c in pairs)  # cell right, reference wrong
    lost = sum(f and not c for f, c in pairs)
    neither = n - both - gained - lost
    cell, ref = (both + gained) / n, (both + lost) / n
    (l1, u1), (l2, u2) = wilson_interval(both + gained, n, z), wilson_interval(both + lost, n, z)
    margins = (both + gained) * (lost + neither) * (both + lost) * (gained + neither)
    cross = both * neither - gained * lost
    # the correlation of the pairs, its positive values corrected for continuity (Newcombe's phi)
    phi = 0.0 if margins == 0 else (cross - n / 2 if cross > n / 2 else min(cross, 0)) / math.sqrt(margins)
    low = (cell - l1) ** 2 - 2 * phi * (cell - l1) * (u2 - ref) + (u2 - ref) ** 2
    high = (u1 - cell) ** 2 - 2 * phi * (u1 - cell) * (ref - l2) + (ref - l2) ** 2
    difference = cell - ref
    return difference, difference - math.sqrt(max(low, 0.0)), difference + math.sqrt(max(high, 0.0))


@dataclass
class CellSummary:
    method: str
    budget: int | None
    n: int
    correct: int | None
    accuracy: float | None
    ci_low: float | None
    ci_high: float | None
    retained: float | None
    mean_generated_tokens: float
    max_generated_tokens: int
    kv_compression: float | None
    peak_kv_mib: float
    max_peak_kv_mib: float
    tokens_per_s: float
    perplexity: float | None = None
    peak_live_tokens_per_head: float | None = None
    compression_events: float | None = None
    compressed_share: float | None = None
    over_bound: int | None = None  # rows whose steady peak live tokens per kv head exceed 1.5 x their bound
    prefill_over_bound: int | None = None  # rows over the bound in the prefill transient only
    steady_live_tokens_per_head: float | None = None  # peak after the first compression, mean over rows
    bound_unknown: int | None = None  # rows that cannot be checked (no kv_heads recorded)
    lost: int | None = None  # paired with full: full right, this cell wrong
    gained: int | None = None  # full wrong, this cell right
    paired_p: float | None = None  # exact McNemar p-value of lost vs gained
    random_lost: int | None = None  # paired with random at the same budget: random right, this cell wrong
    random_gained: int | None = None
    random_p: float | None = None
    prompt: str | None = None  # "kept" (protect_prompt), "pinned" (pin_prompt), "competes", "mixed"; None: no budget
    at_cap: int | None = None  # rows that stopped at max_new_tokens (finish_reason "length"); None if unrecorded
    effective_budget: float | None = None  # live tokens per kv head kept after a compression, prompt included
    paired_p_holm: float | None = None  # paired_p adjusted by Holm over the vs-full column
    random_p_holm: float | None = None  # random_p adjusted by Holm over the vs-random column
    diff_vs_full: float | None = None  # accuracy minus full's on the same samples
    diff_low: float | None = None  # its 95% interval (Newcombe's hybrid score, paired)
    diff_high: float | None = None

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def batch_tokens_per_s(group: list[dict[str, Any]]) -> float:
    """Generated tokens per second of decoding, over the cell's batches.

    A row's own ``tokens_per_s`` divides its tokens by the decode time until it ended, on the
    clock its batch shares: at batch 50 that is about a fiftieth of what the machine produced.
    Rows carry no batch number, so batches are found from their clocks: a row began at ``time -
    decode_s - prefill_s`` (``time`` is when it was written, after it ended), and batches run one
    after another, so a row that began after every row so far had been written opens the next
    batch.  A batch decodes until its last row ends (its largest ``decode_s``).  Batches that
    overlap (writers in parallel) merge into one, timed by its longest decode: the machine's rate,
    overstated when they started apart.  Rows without these clocks (perplexity chunks) give the
    mean of their own rates.
    """
    if any(r.get(k) is None for r in group for k in ("time", "prefill_s", "decode_s")):
        return _mean([r.get("tokens_per_s", 0.0) for r in group])
    def began(r: dict[str, Any]) -> float:
        return r["time"] - r["decode_s"] - r["prefill_s"]

    seconds, batch_decode, batch_written = 0.0, 0.0, -math.inf
    for r in sorted(group, key=began):
        if began(r) >= batch_written:  # began after the batch so far ended
            seconds += batch_decode
            batch_decode = 0.0
        batch_decode = max(batch_decode, r["decode_s"])
        batch_written = max(batch_written, r["time"])
    seconds += batch_decode
    return sum(r.get("generated_tokens", 0) for r in group) / seconds if seconds else 0.0


def _compression(row: dict[str, Any]) -> float | None:
    kept = row.get("final_kv_tokens_mean") or row.get("final_kv_tokens") or 0
    if kept <= 0:
        return None
    return (row["prompt_tokens"] + row.get("generated_tokens", 0)) * row.get("kv_heads", 1) / kept


OVER_BOUND = 1.5  # peak live tokens per kv head over this many times the bound: flagged


def bound_of(row: dict[str, Any]) -> int | None:
    """The most live tokens per kv head a row's budget allows after a compression: the budget,
    plus the prompt when the row's settings protect it; None for a row without a budget."""
    budget = row.get("budget")
    if budget is None:
        return None
    settings = row.get("settings") or {}
    return budget + (row.get("prompt_tokens", 0) if settings.get("protect_prompt") else 0)


def over_bound(row: dict[str, Any], peak: str = "steady_peak_kv_tokens") -> bool | None:
    """True if the row's peak live tokens per kv head after its first compression (``peak``; rows
    written before rows carried it: its whole peak) exceed ``OVER_BOUND`` x ``bound_of(row)``;
    None when that cannot be known (no budget, or no ``kv_heads``: never guessed)."""
    bound, heads = bound_of(row), row.get("kv_heads")
    tokens = row.get(peak, row.get("peak_kv_tokens"))
    if bound is None or not heads or tokens is None:
        return None
    return tokens / heads > OVER_BOUND * bound


def prefill_over_bound(row: dict[str, Any]) -> bool:
    """True if only the row's prefill transient exceeds ``OVER_BOUND`` x its bound (its whole peak
    does, its steady peak does not); False for rows without a steady peak recorded."""
    return "steady_peak_kv_tokens" in row and over_bound(row, "peak_kv_tokens") is True and not over_bound(row)


def shared_pairs(reference: dict[str, dict[str, Any]] | None, graded: list[dict[str, Any]]) -> list[tuple[bool, bool]]:
    """(reference correct, this row correct) for each of ``graded``'s samples that the
    ``reference`` cell's rows (by id) also graded; [] without a reference."""
    if reference is None:
        return []
    return [(bool(reference[r["id"]]["correct"]), bool(r["correct"])) for r in graded
            if r["id"] in reference and reference[r["id"]].get("correct") is not None]


def paired(pairs: list[tuple[bool, bool]]):
    """``(lost, gained, p)`` over ``shared_pairs``, or ``(None, None, None)`` when there are none."""
    if not pairs:
        return None, None, None
    lost, gained = sum(f and not c for f, c in pairs), sum(c and not f for f, c in pairs)
    return lost, gained, mcnemar_p(lost, gained)


def prompt_fate(group: list[dict[str, Any]]) -> str | None:
    """The prompt column: "kept", "pinned", "competes" or "mixed" over a budgeted cell's rows, else None."""
    def fate(settings: dict) -> str:
        return "kept" if settings.get("protect_prompt") else "pinned" if settings.get("pin_prompt") else "competes"

    fates = {fate(r.get("settings") or {}) for r in group if r.get("budget") is not None}
    return None if not fates else fates.pop() if len(fates) == 1 else "mixed"


def cell_order(key: tuple[str, int | None]) -> tuple:
    method, budget = key
    return (method != "full", method, budget is None, budget or 0)


def summarize(rows: list[dict[str, Any]]) -> list[CellSummary]:
    """One ``CellSummary`` per (method, budget), ``full`` first."""
    cells: dict[tuple[str, int | None], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["method"], row["budget"]), []).append(row)
    by_id = {key: {r["id"]: r for r in group} for key, group in cells.items()}
    out = []
    for key in sorted(cells, key=cell_order):
        group = cells[key]
        graded = [r for r in group if r.get("correct") is not None]
        correct = sum(bool(r["correct"]) for r in graded)
        accuracy = correct / len(graded) if graded else None
        low, high = wilson_interval(correct, len(graded)) if graded else (None, None)
        pairs = shared_pairs(by_id.get(("full", None)), graded)
        full_acc = sum(f for f, _ in pairs) / len(pairs) if pairs else None
        retained = accuracy / full_acc if accuracy is not None and full_acc else None
        lost, gained, paired_p = paired(pairs if key != ("full", None) else [])
        difference = paired_difference_interval(pairs) if pairs and key != ("full", None) else (None, None, None)
        bounds = [bound_of(r) for r in group if bound_of(r) is not None]
        random_key = ("random", key[1]) if key[1] is not None and key[0] != "random" else None
        random_lost, random_gained, random_p = paired(shared_pairs(by_id.get(random_key), graded))
        ratios = [c for c in map(_compression, group) if c is not None]
        scored = [r for r in group if r.get("nll") is not None]
        ppl = math.exp(sum(r["nll"] for r in scored) / max(sum(r["scored_tokens"] for r in scored), 1)) if scored else None
        gen = [r.get("generated_tokens", 0) for r in group]
        mib = [r.get("peak_kv_bytes", 0) / 2**20 for r in group]
        peaks = [r["peak_kv_tokens"] / r.get("kv_heads", 1) for r in group if r.get("peak_kv_tokens")]
        steady = [r["steady_peak_kv_tokens"] / r.get("kv_heads", 1) for r in group if r.get("steady_peak_kv_tokens")]
        events = [r["compression_events"] for r in group if r.get("compression_events") is not None]
        flags = [over_bound(r) for r in group]
        out.append(CellSummary(
            method=key[0], budget=key[1], n=len(group), correct=correct if graded else None, accuracy=accuracy,
            ci_low=low, ci_high=high, retained=retained, mean_generated_tokens=_mean(gen),
            max_generated_tokens=max(gen), kv_compression=_mean(ratios) if ratios else None,
            peak_kv_mib=_mean(mib), max_peak_kv_mib=max(mib), tokens_per_s=batch_tokens_per_s(group),
            perplexity=ppl, peak_live_tokens_per_head=_mean(peaks) if peaks else None,
            compression_events=_mean(events) if events else None,
            compressed_share=sum(e > 0 for e in events) / len(events) if events else None,
            over_bound=None if key[1] is None else sum(f is True for f in flags),
            prefill_over_bound=None if key[1] is None else sum(map(prefill_over_bound, group)),
            steady_live_tokens_per_head=_mean(steady) if steady else None,
            bound_unknown=None if key[1] is None else sum(f is None for f in flags),
            lost=lost, gained=gained, paired_p=paired_p, random_lost=random_lost, random_gained=random_gained,
            random_p=random_p, prompt=prompt_fate(group),
            at_cap=sum(r.get("finish_reason") == "length" for r in group) if any("finish_reason" in r for r in group)
            else None,
            effective_budget=_mean(bounds) if key[1] is not None and bounds else None,
            diff_vs_full=difference[0], diff_low=difference[1], diff_high=difference[2]))
    for p_field, holm_field in (("paired_p", "paired_p_holm"), ("random_p", "random_p_holm")):
        family = [s for s in out if getattr(s, p_field) is not None]
        for s, adjusted in zip(family, holm([getattr(s, p_field) for s in family])):
            setattr(s, holm_field, adjusted)
    return out


# ---------------------------------------------------------------------------- formatting
def _fmt(value, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


COLUMNS = ("method", "budget", "eff. budget", "prompt", "n", "accuracy", "95% CI", "retained", "vs full (p; Holm)",
           "Δ vs full (95% CI)", "vs random (p; Holm)", "gen mean", "gen max", "at cap", "KV compr.", "peak KV MiB", "peak live/head", "steady/head", "bound", "events",
           "tok/s")
_QUALITY = slice(5, 11)  # the accuracy columns, replaced by perplexity on a text grid


def _versus(lost: int | None, gained: int | None, p: float | None, missing: str, adjusted: float | None = None) -> str:
    """``-lost/+gained (p)`` against a reference cell (``(p; Holm q)`` with an ``adjusted`` p), or
    ``missing`` for a cell without a pairing."""
    if lost is None:
        return missing
    return f"-{lost}/+{gained} ({p:.2g}" + ("" if adjusted is None else f"; Holm {adjusted:.2g}") + ")"


def points(share: float) -> str:
    """A share as signed whole points: 0.03 -> "+3", -0.1 -> "-10", 0.001 -> "0"."""
    value = round(100 * share)
    return f"{value:+d}" if value else "0"


def difference_text(s: CellSummary) -> str:
    """``Δ (low, high)`` in points, e.g. ``-4 (-11, +3)``, or "-" for a cell not paired with full."""
    if s.diff_vs_full is None:
        return "-"
    return f"{points(s.diff_vs_full)} ({points(s.diff_low)}, {points(s.diff_high)})"


def _versus_full(s: CellSummary, missing: str) -> str:
    return _versus(s.lost, s.gained, s.paired_p, missing)


def bound_text(s: CellSummary) -> str:
    """The bound column: "-" without a budget, "OVER k/n", "unknown" or "ok", then "(prefill k/n)"
    for rows over in the prefill transient only (see the definitions)."""
    if s.over_bound is None:
        return "-"
    transient = f" (prefill {s.prefill_over_bound}/{s.n})" if s.prefill_over_bound else ""
    if s.over_bound:
        return f"OVER {s.over_bound}/{s.n}{transient}"
    return ("unknown" if s.bound_unknown else "ok") + transient


def _compression_text(s: CellSummary) -> str:
    return _fmt(s.kv_compression, ".2f") + ("x" if s.kv_compression else "")


def table_rows(summaries: list[CellSummary]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Column names and formatted cells, shared by markdown and the terminal table
    (perplexity replaces accuracy for the ``text`` data set)."""
    has_ppl = any(s.perplexity is not None for s in summaries)
    columns = COLUMNS if not has_ppl else (*COLUMNS[:_QUALITY.start], "perplexity", *COLUMNS[_QUALITY.stop:])
    rows = []
    for s in summaries:
        if has_ppl:
            quality: tuple[str, ...] = (_fmt(s.perplexity, ".3f"),)
        else:
            ci = f"{s.ci_low:.2f}-{s.ci_high:.2f}" if s.ci_low is not None else "-"
            quality = (_fmt(s.accuracy, ".3f"), ci, _fmt(s.retained, ".0%"),
                       _versus(s.lost, s.gained, s.paired_p, "-", s.paired_p_holm), difference_text(s),
                       _versus(s.random_lost, s.random_gained, s.random_p, "-", s.random_p_holm))
        compression = _compression_text(s)
        if s.compression_events is None:
            events = "-"
        elif s.budget is not None and not s.compressed_share:
            events = "never compressed"
        else:
            events = f"{s.compression_events:.1f} ({s.compressed_share:.0%})"
        rows.append((s.method, _fmt(s.budget, "d", "none"), _fmt(s.effective_budget, ".0f"), s.prompt or "-", str(s.n), *quality, _fmt(s.mean_generated_tokens, ".1f"),
                     str(s.max_generated_tokens), _fmt(s.at_cap, "d"), compression, _fmt(s.peak_kv_mib, ".2f"),
                     _fmt(s.peak_live_tokens_per_head, ".0f"), _fmt(s.steady_live_tokens_per_head, ".0f"),
                     bound_text(s), events, _fmt(s.tokens_per_s, ".1f")))
    return columns, rows


def markdown_table(summaries: list[CellSummary]) -> str:
    columns, rows = table_rows(summaries)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def side_by_side_table(summaries: list[CellSummary]) -> str | None:
    """Markdown: a row per method, a column group per budget (largest first): correct/n, the
    paired comparison with ``full``, KV compression and mean generated tokens.  Rows sorted by
    accuracy at the largest budget, then the next.  None for perplexity grids or one budget."""
    if any(s.perplexity is not None for s in summaries):
        return None
    budgets = sorted({s.budget for s in summaries if s.budget is not None}, reverse=True)
    if len(budgets) < 2:
        return None
    cells = {(s.method, s.budget): s for s in summaries}
    methods = sorted({s.method for s in summaries if s.budget is not None},
                     key=lambda m: ([-(cells[m, b].accuracy or 0) if (m, b) in cells else 1 for b in budgets], m))
    columns = ["method"] + [f"{b}: {c}" if c == "correct" else c for b in budgets
                            for c in ("correct", "vs full (p)", "KV compr.", "gen mean")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    full = cells.get(("full", None))
    if full is not None:
        lines.append("| full | " + " | ".join([f"{full.correct}/{full.n}", "", "1.00x", f"{full.mean_generated_tokens:.0f}"]
                                               + [""] * 4 * (len(budgets) - 1)) + " |")
    for method in methods:
        row = [method]
        for budget in budgets:
            s = cells.get((method, budget))
            if s is None:
                row += ["-"] * 4
                continue
            row += [f"{s.correct}/{s.n}", _versus_full(s, ""), _compression_text(s), f"{s.mean_generated_tokens:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def by_accuracy(summaries: list[CellSummary]) -> list[CellSummary]:
    """The graded cells, best first (a stable sort: ties keep ``summarize``'s cell order)."""
    return sorted((s for s in summaries if s.accuracy is not None), key=lambda s: -s.accuracy)


PAIRWISE_MAX_CELLS = 20  # beyond this a cell-by-cell matrix is too wide to read


def pairwise_splits(rows: list[dict[str, Any]], summaries: list[CellSummary]) -> dict[tuple[str, str], tuple[int, int, float, float]]:
    """Every two graded cells paired on the samples both graded (``shared_pairs``, ``paired``), by
    label, the more accurate first (``by_accuracy``): ``(first only right, second only right, p,
    Holm p)``, the Holm family being all the pairs."""
    order = by_accuracy(summaries)
    graded: dict[tuple[str, int | None], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get("correct") is not None:
            graded.setdefault((r["method"], r["budget"]), {})[r["id"]] = r
    splits = {}
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            # B as the reference: "lost" is B right and A wrong, "gained" the reverse
            b_only, a_only, p = paired(shared_pairs(graded[b.method, b.budget], list(graded[a.method, a.budget].values())))
            if p is not None:
                splits[a.label, b.label] = (a_only, b_only, p)
    return {k: (*v, q) for (k, v), q in zip(splits.items(), holm([p for _, _, p in splits.values()]))}


def pairwise_table(rows: list[dict[str, Any]], summaries: list[CellSummary],
                   max_cells: int = PAIRWISE_MAX_CELLS) -> str | None:
    """Markdown: every two graded cells paired (``pairwise_splits``).  The entry in row A, column B
    is ``a/b (p; Holm q)``: A right and B wrong on ``a`` samples, the reverse on ``b``, the exact
    McNemar p of that split and its Holm adjustment over the table's pairs, bold where the Holm p
    is below 0.05.  Cells sorted by accuracy, best first.  None for fewer than two graded cells or
    more than ``max_cells``."""
    order = by_accuracy(summaries)
    if not 2 <= len(order) <= max_cells:
        return None
    splits = pairwise_splits(rows, summaries)
    lines = ["| | " + " | ".join(s.label for s in order) + " |", "|---|" + "---|" * len(order)]
    for a in order:
        entries = []
        for b in order:
            if (a.label, b.label) in splits:
                a_only, b_only, p, q = splits[a.label, b.label]
            elif (b.label, a.label) in splits:
                b_only, a_only, p, q = splits[b.label, a.label]
            else:
                entries.append("-")
                continue
            text = f"{a_only}/{b_only} ({p:.2g}; Holm {q:.2g})"
            entries.append(f"**{text}**" if q < 0.05 else text)
        lines.append(f"| {a.label} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def rich_table(summaries: list[CellSummary], title: str = ""):
    from rich import box
    from rich.table import Table

    columns, rows = table_rows(summaries)
    table = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    return table


def write_csv(summaries: list[CellSummary], path: Path) -> None:
    names = [f.name for f in fields(CellSummary)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for s in summaries:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(s).items()})


# ---------------------------------------------------------------------------- the report
@dataclass
class Report:
    directory: Path
    summaries: list[CellSummary]
    files: list[Path]
    manifest: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # "file:line: what is wrong" of each row left out


def _header(rows: list[dict[str, Any]], sources: list["Source"]) -> str:
    manifest = sources[0].manifest
    ids = {r["id"] for r in rows}
    model = manifest.get("model") or rows[0].get("model")
    dataset = manifest.get("dataset") or rows[0].get("dataset")
    settings = ", ".join(f"{k}={manifest[k]}" for k in ("max_new_tokens", "temperature", "seed", "dtype")
                         if k in manifest)
    lines = [f"# kvsieve evaluation: {model} on {dataset}", "",
             f"{len(rows)} rows over {len(ids)} samples. Decoding: {settings or 'unknown (no run.json)'}."]
    if len(sources) > 1:  # joined directories: say which rows came from which commit
        lines += ["", "Rows joined from:"] + [
            f"- `{s.path}` ({', '.join(s.methods)}): commit {s.manifest.get('source_commit', 'unknown')[:12]}"
            + (f"; its own `full` (left out) has the first directory's text on all {s.full_reproduced} samples "
               "both hold" if s.full_reproduced is not None else "")
            for s in sources]
    elif manifest.get("source_commit"):
        lines += ["", f"Source commit: {manifest['source_commit'][:12]}."]
    return "\n".join(lines) + "\n"


# run.json fields that must agree for rows of two directories to share a table
JOIN_FIELDS = ("model", "dataset", "data_path", "max_new_tokens", "temperature", "seed", "dtype", "prefill_chunk")


@dataclass
class Source:
    """One results directory of a (joined) report: its run.json, the methods of its rows, and for a
    joined directory the samples whose ``full`` text equals the first directory's (its own
    ``full`` rows, which every ``kvsieve eval`` writes as its reference, are then left out)."""

    path: Path
    manifest: dict[str, Any]
    methods: list[str]
    full_reproduced: int | None = None


def reproduced_full(reference: list[dict[str, Any]], found: list[dict[str, Any]], path: Path) -> int:
    """How many samples of ``found``'s ``full`` rows have the text of ``reference``'s ``full`` rows;
    an error naming the samples where the texts differ (the two runs' code decodes differently)."""
    texts = {r["id"]: r.get("text") for r in reference if r["method"] == "full"}
    mine = [r for r in found if r["method"] == "full" and r["id"] in texts]
    differ = sorted(str(r["id"]) for r in mine if r.get("text") != texts[r["id"]])
    if differ:
        raise ValueError(f"full's text in {path} differs from the first directory's on samples "
                         f"{', '.join(differ[:10])}{' ...' if len(differ) > 10 else ''}: the two runs do not decode "
                         "alike, so their cells cannot share one table")
    return len(mine)


def joined_rows(directory: Path, join: list[Path], bad: list[str] | None = None) -> tuple[list[dict[str, Any]], list[Source]]:
    """Rows of ``directory`` and of each ``join`` directory, which must have been run with the same
    model, data and decoding (``JOIN_FIELDS`` of run.json) and hold no (method, budget) cell of another.
    ``full`` is the exception: each ``kvsieve eval`` directory has its own reference, so a joined
    directory's ``full`` must reproduce the first directory's text on every sample both hold
    (``reproduced_full``: the runs' code decodes alike) and its rows are left out.  ``bad``: as
    ``load_results``'s (None: a bad row is an error)."""
    sources, rows, owner = [], [], {}
    for path in [directory, *join]:
        found = load_results(path, bad)
        if not found:
            first_bad = f"; every line is bad, the first: {bad[0]}" if bad else ""
            raise ValueError(f"no result rows in {path} (expected results*.jsonl written by `kvsieve eval`){first_bad}")
        manifest = read_manifest(path)
        if sources:
            first = sources[0]
            differ = [k for k in JOIN_FIELDS if first.manifest.get(k) != manifest.get(k)]
            if differ:
                k = differ[0]
                raise ValueError(f"cannot join {path} to {first.path}: run.json's {k} differs ({manifest.get(k)!r} "
                                 f"vs {first.manifest.get(k)!r}); join only runs of the same settings")
        reproduced = None
        if sources and ("full", None) in owner:
            reproduced = reproduced_full(rows, found, path)
            found = [r for r in found if r["method"] != "full"]
        for cell in {(r["method"], r["budget"]) for r in found}:
            if cell in owner:
                raise ValueError(f"cell {cell[0]}@{cell[1]} is in both {owner[cell]} and {path}; "
                                 "join directories that hold different cells")
            owner[cell] = path
        sources.append(Source(path, manifest, sorted({r["method"] for r in found}), reproduced))
        rows += found
    return rows, sources


def common_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Only the samples that every (method, budget) cell has, so cells of a partly finished grid
    are compared on the same problems (``full``'s accuracy is then the same reference for all)."""
    per_cell: dict[tuple, set] = {}
    for r in rows:
        per_cell.setdefault((r["method"], r["budget"]), set()).add(r["id"])
    shared = set.intersection(*per_cell.values()) if per_cell else set()
    return [r for r in rows if r["id"] in shared]


def write_report(directory: str | Path, plots: bool = True, common: bool = False,
                 join: list[str | Path] = ()) -> Report:
    """Write ``report.md``, ``summary.csv`` and (with ``plots``) the PNG plots into ``directory``;
    ``common`` keeps only the samples every cell has (``common_rows``); ``join`` adds the cells of
    other results directories run with the same settings (``joined_rows``), e.g. a method run later
    from its own pinned commit.  A line of a results file that is no row is left out and named,
    with its line number, in ``Report.skipped``."""
    directory = Path(directory)
    skipped: list[str] = []
    rows, sources = joined_rows(directory, [Path(p) for p in join], skipped)
    check_writable(directory, "report directory")
    if common:
        rows = common_rows(rows)
        if not rows:
            raise ValueError(f"no sample is shared by every cell in {directory}; drop --common")
    manifest = sources[0].manifest
    summaries = summarize(rows)
    files = [directory / "summary.csv", directory / "report.md"]
    write_atomic(files[0], lambda tmp: write_csv(summaries, tmp), "writing the summary")
    body = [_header(rows, sources), markdown_table(summaries), ""]
    wide = side_by_side_table(summaries)
    if wide is not None:
        body += ["## Side by side", "", "A row per method, sorted by accuracy at the largest budget, then the next.",
                 "", wide, ""]
    pairs = pairwise_table(rows, summaries)
    if pairs is not None:
        body += ["## Every two cells, paired", "",
                 "Row A, column B: `a/b (p; Holm q)`, A right and B wrong on a samples, the reverse on b, the exact "
                 "McNemar p of that split and that p adjusted by Holm's method over all the table's pairs (bold where "
                 "the Holm p is below 0.05: beyond chance after the adjustment). Cells by accuracy, best first.", "",
                 pairs, ""]
    if plots:
        from .plots import draw_all

        pngs = draw_all(rows, summaries, directory, manifest.get("max_new_tokens"))
        files += pngs
        body += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    body += ["## Definitions", "", __doc__.split("Definitions (every number is computed from the rows alone):")[1].strip(), ""]
    write_atomic(files[1], "\n".join(body), "writing the report")
    return Report(directory, summaries, files, manifest, skipped)
