"""PNG plots of a results directory (matplotlib, Agg backend: no display needed).

* ``accuracy_vs_budget.png``: accuracy (or perplexity) against the KV budget, one line per
  method with 95% intervals (a small panel per method, best first, for grids of more than
  ``ONE_AXES_METHODS``); ``full`` as a horizontal band.  A grid of one budget and more methods
  than that gets the cells ranked instead (``cells_ranked``): a row per cell, best first.
* ``kv_memory_vs_length.png``: peak KV memory against sequence length, one series per cell, or
  per budget in large grids (the memory figure of LazyEviction: a full cache grows with the
  output, a budget does not).
* ``accuracy_vs_peak_kv.png``: the Pareto view, accuracy (95% interval) against each cell's mean
  peak KV MiB, every cell a point labelled ``method@budget`` (a colour per method, a marker per
  prompt fate), with the cells no other cell beats on both axes joined by a line (accuracy grids
  only).
* ``generated_length.png``: distribution of generated lengths per cell, a panel per budget with
  ``full`` in each (compression often makes reasoning longer: SkipKV, Observation 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .report import CellSummary, by_accuracy, cell_order


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series_style(plt, i: int) -> dict:
    """Colour and marker of the i-th series: tab20's ten dark hues, then their light pairs (so
    neighbours never differ by shade alone), and a marker that changes every 10, so a grid with
    more methods than matplotlib's 10-colour cycle never draws two alike."""
    return dict(color=plt.get_cmap("tab20")(2 * (i % 10) + (i // 10) % 2), marker="os^Dv<>ph*"[(i // 10) % 10])


PROMPT_MARKERS = {"kept": ("s", "prompt kept"), "pinned": ("v", "prompt pinned in the budget"),
                  "competes": ("o", "prompt competes"), "mixed": ("^", "prompt mixed"), None: ("D", "no budget")}


def base_method(s: CellSummary) -> str:
    """The method without its cell tag: ``lazy+protect`` and ``lazy`` are one method, two cells."""
    return s.method.split("+")[0]


def cell_styles(plt, cells: list[CellSummary]) -> tuple[dict[str, int], Callable[[CellSummary], dict]]:
    """For plots of cells: the colour index of each method (``base_method``), and a function
    giving a cell its colour and its prompt fate's marker."""
    colour = {method: i for i, method in enumerate(sorted({base_method(s) for s in cells}))}
    return colour, lambda s: {**_series_style(plt, colour[base_method(s)]), "marker": PROMPT_MARKERS[s.prompt][0]}


def accuracy_span(cells: list[CellSummary], pad: float = 0.05) -> tuple[float, float]:
    """Axis limits that hold every cell's 95% interval with ``pad`` to spare, within [0, 1]."""
    return max(0.0, min(s.ci_low for s in cells) - pad), min(1.0, max(s.ci_high for s in cells) + pad)


ONE_AXES_METHODS = 8  # more methods than this get a panel each: 20 lines on one axes cannot be told apart


def _budget_series(summaries: list[CellSummary]) -> dict[str, list[CellSummary]]:
    """method -> its budgeted cells, smallest budget first."""
    series: dict[str, list[CellSummary]] = {}
    for s in sorted((s for s in summaries if s.budget is not None), key=lambda s: s.budget):
        series.setdefault(s.method, []).append(s)
    return series


def panel_methods(summaries: list[CellSummary]) -> list[list[str]]:
    """The methods each panel of ``accuracy_vs_budget`` draws: all on one axes up to
    ``ONE_AXES_METHODS``, else one each, best first at the method's largest budget (highest
    accuracy, or lowest perplexity)."""
    series = _budget_series(summaries)
    if len(series) <= ONE_AXES_METHODS:
        return [sorted(series)]
    use_ppl = any(s.perplexity is not None for s in summaries)
    score = (lambda m: series[m][-1].perplexity) if use_ppl else (lambda m: -(series[m][-1].accuracy or 0))
    return [[m] for m in sorted(series, key=lambda m: (score(m), m))]


def accuracy_vs_budget(summaries: list[CellSummary], path: Path) -> Path:
    """One axes with a line per method, or, for larger grids, one small panel per method
    (``panel_methods``), each with ``full``'s value and interval behind it."""
    plt = _pyplot()
    use_ppl = any(s.perplexity is not None for s in summaries)
    budgets = sorted({s.budget for s in summaries if s.budget is not None})
    series = _budget_series(summaries)
    references = [s for s in summaries if s.budget is None and (s.perplexity if use_ppl else s.accuracy) is not None]
    if len(budgets) == 1 and not use_ppl and len(series) > ONE_AXES_METHODS:
        return cells_ranked(summaries, budgets[0], path)
    plan = panel_methods(summaries)
    if len(plan) == 1:
        fig, ax = plt.subplots(figsize=(8.5, 4.5))
        panels = [(ax, plan[0], "perplexity vs KV budget" if use_ppl else "accuracy vs KV budget")]
    else:
        cols = 5
        rows = -(-len(plan) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.1 * rows), sharex=True, sharey=True,
                                 squeeze=False)
        panels = [(ax, methods, methods[0]) for ax, methods in zip(axes.flat, plan)]
        for ax in list(axes.flat)[len(plan):]:
            ax.set_visible(False)
        fig.suptitle(f"{'perplexity' if use_ppl else 'accuracy (95% Wilson CI)'} vs KV budget, "
                     f"one panel per method, best first; dashed: full")
        fig.supxlabel("KV budget (tokens per kv head)")
    style = {method: i for i, method in enumerate(sorted(series))}  # a method looks the same in either layout
    for ax, methods, title in panels:
        _draw_references(ax, references, use_ppl)
        for slot, method in enumerate(methods):
            _draw_series(ax, series[method], method, style[method], slot, len(methods), use_ppl, plt)
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlim(budgets[0] / 1.3, budgets[-1] * 1.3)
        if not use_ppl:
            ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(title, **({"fontsize": 10} if len(panels) > 1 else {}))
    if len(panels) == 1:
        ax = panels[0][0]
        ax.set_xlabel("KV budget (tokens per kv head)")
        ax.set_ylabel("perplexity" if use_ppl else "accuracy (95% Wilson CI)")
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))  # beside the axes, never over a point
    return _save(fig, plt, path)


def cells_ranked(summaries: list[CellSummary], budget: int, path: Path) -> Path:
    """A grid of one budget and many methods: a row per graded cell, best first, its accuracy and
    95% interval along x (``full``'s as a dashed line and band), a marker per prompt fate as in
    ``accuracy_vs_peak_kv``; panels of one point each would say less."""
    plt = _pyplot()
    fig, _ = ranked_figure(plt, summaries, budget)
    return _save(fig, plt, path)


def ranked_figure(plt, summaries: list[CellSummary], budget: int):
    """``cells_ranked``'s figure and axes (its y tick labels name the cells, best first)."""
    cells = by_accuracy(summaries)
    fig, ax = plt.subplots(figsize=(7.5, 0.28 * len(cells) + 1.4))
    _, style = cell_styles(plt, cells)
    for row, s in enumerate(cells):
        if s.method == "full":
            ax.axvline(s.accuracy, linestyle="--", color="black", linewidth=1)
            ax.axvspan(s.ci_low, s.ci_high, color="black", alpha=0.07)
        err = [[s.accuracy - s.ci_low], [s.ci_high - s.accuracy]]
        ax.errorbar([s.accuracy], [row], xerr=err, capsize=2, linestyle="none", **style(s))
    ax.set_yticks(range(len(cells)), [s.label + ("" if s.prompt is None else f" ({s.prompt})") for s in cells],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(*accuracy_span(cells))
    ax.set_xlabel("accuracy (95% Wilson CI)")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(f"accuracy per cell at budget {budget}, best first (dashed and shaded: full)", fontsize=10)
    return fig, ax


def _draw_references(ax, references: list[CellSummary], use_ppl: bool) -> None:
    """``full`` (dashed, with its interval as a band) and self-sizing methods (dotted) as horizontal lines."""
    for s in references:
        full = s.method == "full"
        line = ax.axhline(s.perplexity if use_ppl else s.accuracy, linestyle="--" if full else ":",
                          color="black" if full else None, label=f"{s.method} (n={s.n})")
        if not use_ppl and full and s.ci_low is not None:
            ax.axhspan(s.ci_low, s.ci_high, color=line.get_color(), alpha=0.1)


def _draw_series(ax, cells: list[CellSummary], method: str, style: int, slot: int, count: int, use_ppl: bool,
                 plt) -> None:
    """One method's cells; ``slot`` of ``count`` nudges it sideways so equal values stay visible."""
    nudge = 2 ** (0.03 * (slot - (count - 1) / 2))
    x = [s.budget * nudge for s in cells]
    if use_ppl:
        ax.plot(x, [s.perplexity for s in cells], label=method, **_series_style(plt, style))
        return
    y = [s.accuracy for s in cells]
    err = [[a - s.ci_low for a, s in zip(y, cells)], [s.ci_high - a for a, s in zip(y, cells)]]
    ax.errorbar(x, y, yerr=err, capsize=3, label=method, **_series_style(plt, style))


POOLED = "~every method"  # the cell key of pooled rows; "~" sorts it after named methods


def memory_series(rows: list[dict[str, Any]]) -> dict[str, list[dict]]:
    """Label -> rows of each series in ``kv_memory_vs_length``: a series per cell, ``full`` first;
    in grids of more than ``ONE_AXES_METHODS`` methods, one per budget (every method pooled)."""
    methods_per_budget: dict[int, set] = {}
    for row in rows:
        if row["budget"] is not None:
            methods_per_budget.setdefault(row["budget"], set()).add(row["method"])
    by_budget = len(set().union(*methods_per_budget.values())) > ONE_AXES_METHODS
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        method = POOLED if by_budget and row["budget"] is not None else row["method"]
        cells.setdefault((method, row["budget"]), []).append(row)
    series = {}
    for method, budget in sorted(cells, key=cell_order):
        if budget is None:
            label = method
        elif method == POOLED:
            label = f"every method at budget {budget} ({len(methods_per_budget[budget])} methods)"
        else:
            label = f"{method}@{budget}"
        series[label] = cells[method, budget]
    return series


def kv_memory_vs_length(rows: list[dict[str, Any]], path: Path) -> Path:
    """Left: each sample's own peak live KV tokens per kv head against its generated length (full
    grows with it, a bounded cache stays flat).  Right: the allocated cache bytes per sample (a
    batch's allocation shared by its rows, so samples of one batch share a value).  A series per
    cell, or, in grids of more than ``ONE_AXES_METHODS`` methods, one per budget."""
    plt = _pyplot()
    fig, (tokens_ax, bytes_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    groups = memory_series(rows)
    for i, (label, group) in enumerate(groups.items()):
        group = sorted(group, key=lambda r: r.get("generated_tokens", 0))
        x = [r.get("generated_tokens", 0) for r in group]
        full = label == "full"
        style = dict(color="black", marker="s") if full else _series_style(plt, i)
        line = dict(linestyle="-" if full else "none", alpha=0.7, markersize=4, **style)
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


def length_panels(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    """Panel title -> {box label: generated lengths} for ``generated_length``: a panel per budget
    holding ``full`` (the reference) and every method at that budget, and one for methods that
    size their own cache, if any.  Boxes sorted by name after ``full``."""
    cells: dict[tuple, list[int]] = {}
    for row in rows:
        cells.setdefault((row["method"], row["budget"]), []).append(row.get("generated_tokens", 0))
    full = cells.get(("full", None))
    panels: dict[str, dict[str, list[int]]] = {}
    for budget in sorted({b for _, b in cells if b is not None}):
        panels[f"budget {budget}"] = {}
    if any(m != "full" and b is None for m, b in cells):
        panels["own size"] = {}
    for panel in panels.values():
        if full is not None:
            panel["full"] = full
    for method, budget in sorted(cells, key=cell_order):
        if method != "full":
            panels[f"budget {budget}" if budget is not None else "own size"][method] = cells[method, budget]
    return panels or {"": {"full": full or []}}


def generated_length(rows: list[dict[str, Any]], path: Path, max_new_tokens: int | None = None) -> Path:
    """Horizontal boxes of generated length, a panel per budget (``length_panels``)."""
    plt = _pyplot()
    panels = length_panels(rows)
    tallest = max(len(boxes) for boxes in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1, 0.3 * tallest + 1.8), squeeze=False)
    for ax, (title, boxes) in zip(axes[0], panels.items()):
        labels = list(boxes)[::-1]  # full at the top
        ax.boxplot([boxes[k] for k in labels], orientation="horizontal", showmeans=True, widths=0.6)
        ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=8)
        if max_new_tokens:
            ax.axvline(max_new_tokens, color="grey", linestyle=":")
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3, axis="x")
        ax.set_title(title)
    cap = f"; dotted: max_new_tokens={max_new_tokens}" if max_new_tokens else ""
    fig.suptitle(f"generated length per cell (triangle: mean{cap})")
    return _save(fig, plt, path)


def pareto_front(summaries: list[CellSummary]) -> list[CellSummary]:
    """The cells no other cell dominates (at most the peak KV memory and at least the accuracy,
    better in one), by increasing memory."""
    cells = sorted((s for s in summaries if s.accuracy is not None), key=lambda s: (s.peak_kv_mib, -s.accuracy))
    front: list[CellSummary] = []
    for s in cells:
        if not front or s.accuracy > front[-1].accuracy:
            front.append(s)
    return front


Box = tuple[float, float, float, float]  # x0, y0, x1, y1


def spread_labels(boxes: list[Box], gap: float = 1.0) -> list[float]:
    """How far to move each label box down so that no two overlap: boxes are taken from the
    highest, each kept where it is when it overlaps none placed so far, else moved just below
    the lowest box it overlaps until it is free (display units, y up).  Returns the downward
    shift of each box, in the input order (0 for a box that stays)."""
    placed: list[Box] = []
    shifts = [0.0] * len(boxes)
    for i in sorted(range(len(boxes)), key=lambda i: -boxes[i][3]):
        x0, y0, x1, y1 = boxes[i]
        while True:
            hits = [b for b in placed if x0 < b[2] and b[0] < x1 and y0 < b[3] + gap and b[1] - gap < y1]
            if not hits:
                break
            drop = y1 - min(b[1] for b in hits) + gap
            y0, y1 = y0 - drop, y1 - drop
        shifts[i] = boxes[i][1] - y0
        placed.append((x0, y0, x1, y1))
    return shifts


def accuracy_vs_peak_kv(summaries: list[CellSummary], path: Path) -> Path:
    """Accuracy against mean peak KV MiB, a point per cell: a colour per method (its ``+protect``
    and ``+competes`` cells share it), a marker per prompt fate, labels moved apart where they would
    overlap (``spread_labels``, a thin line back to the point), the Pareto front as a line."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(9, 5))
    cells = [s for s in summaries if s.accuracy is not None]
    colour, style = cell_styles(plt, cells)
    for s in cells:
        err = [[s.accuracy - s.ci_low], [s.ci_high - s.accuracy]]
        ax.errorbar([s.peak_kv_mib], [s.accuracy], yerr=err, capsize=2, linestyle="none", alpha=0.8, **style(s))
    front = pareto_front(cells)
    ax.plot([s.peak_kv_mib for s in front], [s.accuracy for s in front], color="black", alpha=0.4, linewidth=1,
            drawstyle="steps-post")
    ax.set_xscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    if max(s.peak_kv_mib for s in cells) < 10 * min(s.peak_kv_mib for s in cells):  # within a decade: label 20, 30...
        ax.xaxis.set_minor_formatter(plain)
    ax.set_xlabel("peak KV cache per sample (MiB, mean; log scale)")
    ax.set_ylabel("accuracy (95% Wilson CI)")
    low, high = accuracy_span(cells)
    ax.set_ylim(low - 0.02, high + 0.02)
    ax.grid(alpha=0.3)
    ax.set_title("accuracy vs peak KV memory (up and left is better)")
    # colours by method, markers by prompt fate (hollow, so no method's colour is read as a fate)
    handles = [Line2D([], [], linestyle="none", label=method, **{**_series_style(plt, i), "marker": "o"})
               for method, i in colour.items()]
    fates = [fate for fate in PROMPT_MARKERS if any(s.prompt == fate for s in cells)]
    handles += [Line2D([], [], linestyle="none", color="black", markerfacecolor="none", marker=PROMPT_MARKERS[fate][0],
                       label=PROMPT_MARKERS[fate][1]) for fate in fates]
    handles.append(Line2D([], [], color="black", alpha=0.4, linewidth=1, label="Pareto front"))
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    _label_points(fig, ax, cells)
    return _save(fig, plt, path, layout=False)


def _label_points(fig, ax, cells: list[CellSummary], offset: tuple[float, float] = (4, 3)) -> None:
    """Each cell's ``method@budget`` beside its point, moved down (with a line back) where labels
    would overlap; labels stay out of the layout, so placing them moves nothing else."""
    renderer = fig.canvas.get_renderer()
    drafts = [ax.annotate(s.label, (s.peak_kv_mib, s.accuracy), fontsize=6, xytext=offset, textcoords="offset points")
              for s in cells]
    boxes = [tuple(t.get_window_extent(renderer).extents) for t in drafts]
    for draft in drafts:
        draft.remove()
    points_per_pixel = 72 / fig.dpi
    for s, shift in zip(cells, spread_labels(boxes)):
        line = dict(arrowstyle="-", color="grey", alpha=0.5, linewidth=0.5, shrinkA=0, shrinkB=2) if shift else None
        text = ax.annotate(s.label, (s.peak_kv_mib, s.accuracy), fontsize=6, textcoords="offset points",
                           xytext=(offset[0], offset[1] - shift * points_per_pixel), arrowprops=line)
        text.set_in_layout(False)


def _save(fig, plt, path: Path, layout: bool = True) -> Path:
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_all(rows: list[dict[str, Any]], summaries: list[CellSummary], directory: Path,
             max_new_tokens: int | None = None) -> list[Path]:
    """Draw every plot into ``directory``; returns their paths."""
    out = [accuracy_vs_budget(summaries, directory / "accuracy_vs_budget.png"),
           kv_memory_vs_length(rows, directory / "kv_memory_vs_length.png")]
    if any(s.accuracy is not None for s in summaries):
        out.append(accuracy_vs_peak_kv(summaries, directory / "accuracy_vs_peak_kv.png"))
    if any(r.get("generated_tokens") for r in rows):
        out.append(generated_length(rows, directory / "generated_length.png", max_new_tokens))
    return out
