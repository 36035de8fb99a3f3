"""Retention diagnostics of the AMS paper (App. C, Fig. 4-5, Tables 9 and 14), defined here.

The paper reports a Region Wipe-out Rate, retained-set IoU across compressions (with proxy
segments for methods without segments), an n-gram repetition rate and middle-context
retention, but gives no formulas.  kvsieve's definitions, for one (row, layer, kv head) whose
compression events e = 1, 2, ... happen when the row has seen ``n_e`` tokens and leave the kept
positions ``K_e`` (a trace from ``kvsieve.analysis.trace``)::

    positions:  0 ........................ n_{e-1} ............ n_e
    before e:   K_{e-1} (kept at e-1)     | [n_{e-1}, n_e) appended since
    P_e = K_{e-1} U [n_{e-1}, n_e)        (P_1 = [0, n_1): nothing evicted before the first event)

* **Region wipe-out rate**: positions are cut into fixed regions of ``region`` tokens
  ([rR, (r+1)R)).  A region is *present* at event e if P_e holds one of its tokens and *wiped
  out* if K_e holds none.  Rate = wiped regions / present regions, summed over events, layers
  and heads.
* **Retained-set IoU** of consecutive events: tokens appended after e-1 cannot have been kept
  at e-1, so K_e is compared on the positions that existed then:
  ``IoU_e = |K_{e-1} & K_e| / |K_{e-1} | (K_e & [0, n_{e-1}))``.
* **Proxy segments and span IoU** (Fig. 5: "consecutive retained tokens are grouped as proxy
  segments"): the kept positions are grouped into maximal runs whose successive gaps are at
  most ``max_gap``; a run covers [first, last].  Span IoU is the IoU above on the covered
  positions; with ``max_gap`` 1 it equals the token IoU.  Table 14's "#segments" and "seg.
  len" are the run count and mean covered length.  The same proxy runs are used for every
  method (AMS's own segments always cover the whole cache, so they say nothing about retention).
* **Middle-context retention** (Fig. 4a): the share of the positions of the middle third of
  [start, n_e) kept at event e (``start`` 0: the whole context; the prompt length: the
  generated reasoning only); ``retention_profile`` gives the kept share per equal-width bin.
* **Prompt retention** (kvsieve's, for the grid's prompt question, not the paper's): the share
  of the prompt's positions [0, prompt length) kept at event e; the summary is its mean over
  events, layers and heads, and ``prompt_retention_last`` the mean over layers and heads at
  each row's last event.
* **N-gram repetition rate** (Table 9, Fig. 4b): for a token list of length L, the share of
  its L - n + 1 n-grams that repeat an earlier n-gram of the same list,
  ``1 - distinct / total`` (0 when L < n).  Computed on generated token ids when a record has
  them, otherwise on whitespace-separated words of the text; n = 4 by default.

Per-event values come from ``trace_diagnostics``; a run's summary pools them as stated above
(rates over counts, IoUs and retention as means over events, layers and heads).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .commands import register_retention as register  # noqa: F401  (kvsieve analyze retention)


def _positions(x) -> np.ndarray:
    return np.unique(np.asarray(x, dtype=np.int64).reshape(-1))


def region_wipeout(present, kept, region: int) -> tuple[int, int]:
    """(wiped, present) region counts of one event: regions of ``region`` tokens holding a
    present position of which no position is kept."""
    if region < 1:
        raise ValueError(f"region must be >= 1 token, got {region}")
    before, after = np.unique(_positions(present) // region), np.unique(_positions(kept) // region)
    return int(np.setdiff1d(before, after).size), int(before.size)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.union1d(a, b).size
    return float(np.intersect1d(a, b).size / union) if union else 1.0


def retained_iou(prev_kept, kept, prev_n: int) -> float:
    """IoU of K_{e-1} and K_e restricted to positions below ``prev_n`` (module docstring)."""
    kept = _positions(kept)
    return _iou(_positions(prev_kept), kept[kept < prev_n])


def proxy_segments(kept, max_gap: int = 4) -> np.ndarray:
    """[S, 2] (first, last) of the runs of kept positions whose successive gaps are <= max_gap."""
    if max_gap < 1:
        raise ValueError(f"max_gap must be >= 1, got {max_gap}")
    kept = _positions(kept)
    if kept.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(kept) > max_gap)
    return np.stack([kept[np.r_[0, breaks + 1]], kept[np.r_[breaks, kept.size - 1]]], axis=1)


def covered(kept, max_gap: int = 4) -> np.ndarray:
    """Positions covered by the proxy segments of ``kept``."""
    runs = proxy_segments(kept, max_gap)
    return np.concatenate([np.arange(a, b + 1) for a, b in runs]) if len(runs) else np.zeros(0, np.int64)


def span_iou(prev_kept, kept, prev_n: int, max_gap: int = 4) -> float:
    """Retained IoU of the proxy-segment coverage of consecutive events."""
    now = covered(kept, max_gap)
    return _iou(covered(prev_kept, max_gap), now[now < prev_n])


def retention_profile(kept, n: int, bins: int = 10, start: int = 0) -> np.ndarray:
    """[bins] share of the positions of each equal-width bin of [start, n) that are kept."""
    if n <= start or bins < 1:
        return np.full(max(bins, 0), np.nan)
    edges = np.linspace(start, n, bins + 1)
    kept = _positions(kept)
    kept_count = np.histogram(kept[(kept >= start) & (kept < n)], bins=edges)[0]
    size = np.histogram(np.arange(start, n), bins=edges)[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        return kept_count / size


def middle_retention(kept, n: int, start: int = 0) -> float:
    """Share of the middle third of [start, n) that is kept (NaN if it is empty)."""
    lo, hi = start + (n - start) // 3, start + 2 * (n - start) // 3
    if hi <= lo:
        return float("nan")
    kept = _positions(kept)
    return float(((kept >= lo) & (kept < hi)).sum() / (hi - lo))


def prompt_retention(kept, prompt: int) -> float:
    """Share of the prompt's positions [0, prompt) that are kept (NaN without a prompt)."""
    if prompt <= 0:
        return float("nan")
    kept = _positions(kept)
    return float((kept < prompt).sum() / prompt)


def ngram_repetition(tokens: Sequence, n: int = 4) -> float:
    """Share of the n-grams of ``tokens`` that repeat an earlier one: 1 - distinct / total."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def trace_diagnostics(trace, region: int = 32, max_gap: int = 4, start: int = 0, prompt: int = 0) -> dict[str, Any]:
    """Per-event records and the run summary of a ``Trace`` (module docstring); ``prompt`` is the
    prompt's length in tokens (0: no prompt retention)."""
    series = defaultdict(list)  # (row, layer, head) -> [(n_e, K_e)] in event order
    for layer, row, seen, head, kept in zip(trace.layer, trace.row, trace.seen, trace.head, trace.kept):
        series[(row, layer, head)].append((int(seen), _positions(kept)))
    events, wiped, present = [], 0, 0
    for (row, layer, head), items in series.items():
        items.sort(key=lambda item: item[0])
        prev_n, prev = 0, np.zeros(0, np.int64)
        for index, (n, kept) in enumerate(items):
            before = np.union1d(prev, np.arange(prev_n, n))
            w, p = region_wipeout(before, kept, region)
            wiped, present = wiped + w, present + p
            runs = proxy_segments(kept, max_gap)
            record = {"row": row, "layer": layer, "head": head, "seen": n, "kept": int(kept.size),
                      "wiped_regions": w, "present_regions": p, "segments": len(runs),
                      "segment_length": float((runs[:, 1] - runs[:, 0] + 1).mean()) if len(runs) else 0.0,
                      "middle_retention": middle_retention(kept, n, start),
                      "prompt_retention": prompt_retention(kept, prompt), "last": index == len(items) - 1}
            if index:
                record["iou"] = retained_iou(prev, kept, prev_n)
                record["span_iou"] = span_iou(prev, kept, prev_n, max_gap)
            events.append(record)
            prev_n, prev = n, kept

    def mean(key, among=events):
        values = [e[key] for e in among if key in e and not np.isnan(e[key])]
        return float(np.mean(values)) if values else float("nan")

    summary = {"events": len({(e["row"], e["seen"]) for e in events}), "records": len(events),
               "wipeout_rate": wiped / present if present else float("nan"), "iou": mean("iou"),
               "span_iou": mean("span_iou"), "segments": mean("segments"),
               "segment_length": mean("segment_length"), "middle_retention": mean("middle_retention"),
               "prompt_retention": mean("prompt_retention"),
               "prompt_retention_last": mean("prompt_retention", [e for e in events if e["last"]])}
    return {"events": events, "summary": summary}


def _words(row: dict) -> list:
    ids = row.get("token_ids")
    return list(ids) if ids else str(row.get("text", "")).split()


def results_repetition(rows: Iterable[dict], n: int = 4) -> dict[tuple, dict[str, float]]:
    """Mean n-gram repetition and generated tokens per (method, budget) of eval result rows."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row.get("method", "?"), row.get("budget"))].append(row)
    return {key: {"samples": len(rs), "repetition": float(np.mean([ngram_repetition(_words(r), n) for r in rs])),
                  "generated_tokens": float(np.mean([r.get("generated_tokens", 0) for r in rs]))}
            for key, rs in groups.items()}


def _read_rows(path: Path) -> list[dict]:
    if path.is_dir():
        from ..eval.store import load_results

        return load_results(path)
    from ..eval.store import read_rows

    return list(read_rows(path))
