"""PNG plots of a results directory (matplotlib, Agg backend: no display needed).

* ``accuracy_vs_budget.png``: accuracy (or perplexity) against the KV budget, one line per
  method with 95% intervals; ``full`` as a horizontal band.
* ``kv_memory_vs_length.png``: peak KV memory against sequence length, one series per cell
  (the memory figure of LazyEviction: a full cache grows with the output, a budget does not).
* ``generated_length.png``: distribution of generated lengths per cell (compression often
  makes reasoning longer: SkipKV, Observation 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import CellSummary, cell_order


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series_style(plt, i: int) -> dict:
    """Colour and marker of the i-th series: 20 colours, and a marker that changes every 10, so
    a grid with more methods than matplotlib's 10-colour cycle never draws two alike."""
    return dict(color=plt.get_cmap("tab20")(i % 20), marker="os^Dv<>ph*"[(i // 10) % 10])


def accuracy_vs_budget(summaries: list[CellSummary], path: Path) -> Path:
    plt = _pyplot()
    use_ppl = any(s.perplexity is not None for s in summaries)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    budgets = sorted({s.budget for s in summaries if s.budget is not None})
    for s in summaries:
        if s.budget is None:  # full and self-sizing methods: a horizontal reference
            value = s.perplexity if use_ppl else s.accuracy
            if value is None:
                continue
            line = ax.axhline(value, linestyle="--" if s.method == "full" else ":", color="black" if s.method == "full" else None,
                              label=f"{s.method} (n={s.n})")
            if not use_ppl and s.method == "full" and s.ci_low is not None:
                ax.axhspan(s.ci_low, s.ci_high, color=line.get_color(), alpha=0.1)
    methods = sorted({s.method for s in summaries if s.budget is not None})
    for i, method in enumerate(methods):
        cells = sorted((s for s in summaries if s.method == method and s.budget is not None), key=lambda s: s.budget)
        nudge = 2 ** (0.03 * (i - (len(methods) - 1) / 2))  # side by side, so equal values stay visible
        x = [s.budget * nudge for s in cells]
        if use_ppl:
            ax.plot(x, [s.perplexity for s in cells], label=method, **_series_style(plt, i))
            continue
        y = [s.accuracy for s in cells]
        err = [[a - s.ci_low for a, s in zip(y, cells)], [s.ci_high - a for a, s in zip(y, cells)]]
        ax.errorbar(x, y, yerr=err, capsize=3, label=method, **_series_style(plt, i))
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("KV budget (tokens per kv head)")
    ax.set_ylabel("perplexity" if use_ppl else "accuracy (95% Wilson CI)")
    if not use_ppl:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))  # beside the axes, never over a point
    ax.set_title("perplexity vs KV budget" if use_ppl else "accuracy vs KV budget")
    return _save(fig, plt, path)


def kv_memory_vs_length(rows: list[dict[str, Any]], path: Path) -> Path:
    """Left: each sample's own peak live KV tokens per kv head against its generated length (full
    grows with it, a bounded cache stays flat).  Right: the allocated cache bytes per sample (a
    batch's allocation shared by its rows, so samples of one batch share a value)."""
    plt = _pyplot()
    fig, (tokens_ax, bytes_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["budget"]), []).append(row)
    for i, key in enumerate(sorted(groups, key=cell_order)):
        group = sorted(groups[key], key=lambda r: r.get("generated_tokens", 0))
        x = [r.get("generated_tokens", 0) for r in group]
        label = key[0] if key[1] is None else f"{key[0]}@{key[1]}"
        style = dict(color="black", marker="s") if key[0] == "full" else _series_style(plt, i)
        line = dict(linestyle="-" if key[0] == "full" else "none", alpha=0.7, markersize=4, **style)
        tokens_ax.plot(x, [r.get("peak_kv_tokens", 0) / r.get("kv_heads", 1) for r in group], label=label, **line)
        bytes_ax.plot(x, [r.get("peak_kv_bytes", 0) / 2**20 for r in group], **line)
    tokens_ax.set(xlabel="generated tokens", ylabel="peak live KV tokens per kv head (largest layer)",
                  title="the sample's own cache")
    bytes_ax.set(xlabel="generated tokens", ylabel="peak KV MiB allocated per sample",
                 title="allocated (a batch's bytes / its rows)")
    for ax in (tokens_ax, bytes_ax):
        ax.grid(alpha=0.3)
    bytes_ax.legend(*tokens_ax.get_legend_handles_labels(), fontsize=7, ncol=2 if len(groups) > 12 else 1,
                    loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("peak KV memory vs generated length")
    return _save(fig, plt, path)


def generated_length(rows: list[dict[str, Any]], path: Path, max_new_tokens: int | None = None) -> Path:
    plt = _pyplot()
    groups: dict[tuple, list[int]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["budget"]), []).append(row.get("generated_tokens", 0))
    keys = sorted(groups, key=cell_order)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(keys) + 2), 4.5))
    ax.boxplot([groups[k] for k in keys], showmeans=True)
    ax.set_xticks(range(1, len(keys) + 1), [k[0] if k[1] is None else f"{k[0]}@{k[1]}" for k in keys],
                  rotation=45, ha="right")
    title = "generated length per cell\n(triangle: mean"
    if max_new_tokens:  # named in the title: a legend box inside the axes can hide a box's mean
        ax.axhline(max_new_tokens, color="grey", linestyle=":")
        title += f"; dotted: max_new_tokens={max_new_tokens}"
    ax.set_ylabel("generated tokens")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title + ")")
    return _save(fig, plt, path)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_all(rows: list[dict[str, Any]], summaries: list[CellSummary], directory: Path,
             max_new_tokens: int | None = None) -> list[Path]:
    """Draw every plot into ``directory``; returns their paths."""
    out = [accuracy_vs_budget(summaries, directory / "accuracy_vs_budget.png"),
           kv_memory_vs_length(rows, directory / "kv_memory_vs_length.png")]
    if any(r.get("generated_tokens") for r in rows):
        out.append(generated_length(rows, directory / "generated_length.png", max_new_tokens))
    return out
