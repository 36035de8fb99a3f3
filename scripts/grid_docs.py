"""Write the accuracy grid's figures into README.md and docs/*.md from the stages' summary.csv and
report.md, so that regenerating the reports and running this is all a new grading or a new cell needs.

    python scripts/grid_docs.py          # rewrite every generated table and figure in place
    python scripts/grid_docs.py --check  # exit 1, naming the files, if any is not what the CSVs give

Two kinds of generated text, each between markers that GitHub does not show:

* a table: ``<!-- grid:NAME -->`` ... ``<!-- /grid:NAME -->`` on lines of their own, NAME one of
  ``TABLES`` (``choice``: README's "Which method should I use?"; ``stage1``, ``stage2``: a stage's
  every cell);
* a figure in a sentence: ``<!--g STAGE CELL FIELD-->text<!--/g-->``, FIELD one of ``FIELDS``
  (e.g. ``<!--g 1 expected correct-->53/100<!--/g-->``), ``human`` (rows whose text runs into a
  made-up ``Human:`` turn) or ``promptlen`` (mean prompt tokens), both from the rows;
  ``<!--g STAGE A~B pair-->`` for the split of two cells in the report's table of every two
  cells; ``<!--g STAGE * pairs|raw|holm-->`` for how many pairs that table has, and how many
  have a raw or a Holm p below 0.05; ``<!--g STAGE * pareto-->`` for the cells on the Pareto front
  of accuracy against peak KV memory.

A cell is named by its method, with " (no budget)" for a self-sized cell other than full.
tests/test_readme_grid.py checks every one of them, and the tables column by column, against the CSVs.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "results/accuracy-grid"
# stage -> (directory, caption); stage 1's report joins stage 4's cells, stage 2's joins stage 5's
STAGES = {
    "1": (GRID / "stage1-gsm8k-b128", "budget 128, GSM8K 0-99"),
    "2": (GRID / "stage2-math500-b256", "budget 256, MATH-500 100-149"),
}
JOINED = {"1": GRID / "stage4-gsm8k-b128-triattention", "2": GRID / "stage5-math500-b256-triattention"}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHOICE_ROWS = 12  # README's table: stage 1's most accurate cells, the official-default ones, the random control
OFFICIAL = "+official"  # cells that run a method as its official code does (issue 51): always in README's table
# The report gives no prompt fate to a cell without a budget; LagKV's partitions compress the
# prompt with everything else (they cannot set it apart)
PROMPT_WITHOUT_BUDGET = {"full": "-", "lagkv (no budget)": "competes"}


def cell_name(row: dict[str, str]) -> str:
    return row["method"] + (" (no budget)" if not row["budget"] and row["method"] != "full" else "")


def summary(stage: str) -> dict[str, dict[str, str]]:
    """A stage's summary.csv by cell name, in the CSV's order."""
    with (STAGES[stage][0] / "summary.csv").open(encoding="utf-8") as f:
        return {cell_name(r): r for r in csv.DictReader(f)}


def by_accuracy(cells: dict[str, dict[str, str]]) -> list[str]:
    """Cell names, most accurate first (ties keep the CSV's order, as the report's ranking does)."""
    return sorted(cells, key=lambda c: -float(cells[c]["accuracy"]))


def p_text(p: str) -> str:
    return f"{float(p):.2g}"


def points(share: float) -> str:
    value = round(100 * share)
    return f"{value:+d}" if value else "0"


def versus(row: dict[str, str], against: str = "full") -> str:
    """``lost/gained (p; Holm q)`` against full or random, "-" for a cell without that pairing."""
    lost, gained, p, q = (("lost", "gained", "paired_p", "paired_p_holm") if against == "full" else
                          ("random_lost", "random_gained", "random_p", "random_p_holm"))
    return f"{row[lost]}/{row[gained]} ({p_text(row[p])}; Holm {p_text(row[q])})" if row[lost] else "-"


def rows(stage: str) -> list[dict]:
    """The stage's result rows, with those of the directory its report joins (when it has any)."""
    found = []
    for directory in (STAGES[stage][0], JOINED[stage]):
        for path in sorted(directory.glob("results*.jsonl")) if directory.is_dir() else []:
            found += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return found


def human_turns(stage: str, cell: str) -> str:
    """How many of a cell's rows run on into a made-up next turn (their text holds "Human:")."""
    method = cell.replace(" (no budget)", "")
    return str(sum(r["method"] == method and "Human:" in (r.get("text") or "") for r in rows(stage)))


def pair_counts(stage: str, name: str) -> str:
    """Over the report's table of every two cells: ``pairs`` (how many), ``raw`` (raw p below
    0.05) or ``holm`` (Holm p below 0.05)."""
    splits = []
    for line in pair_lines(stage)[2:]:
        splits += re.findall(r"\d+/\d+ \((\S+); Holm (\S+)\)", line)
    index = {"pairs": None, "raw": 0, "holm": 1}[name]
    count = len(splits) if index is None else sum(float(s[index]) < 0.05 for s in splits)
    return str(count // 2)  # each pair appears twice, once each way


def pareto(stage: str) -> str:
    """The cells no other cell beats on both peak KV memory and accuracy, least memory first."""
    cells = summary(stage)
    point = {c: (float(r["peak_kv_mib"]), float(r["accuracy"])) for c, r in cells.items()}
    front = [c for c, (mib, acc) in point.items()
             if not any(m <= mib and a >= acc and (m, a) != (mib, acc) for m, a in point.values())]
    return ", ".join(sorted(front, key=lambda c: point[c][0]))


def field(stage: str, cell: str, name: str) -> str:
    """One figure of a cell as the docs write it."""
    if cell == "*":
        return pareto(stage) if name == "pareto" else pair_counts(stage, name)
    if name == "human":
        return human_turns(stage, cell)
    if name == "promptlen":  # mean prompt tokens of the cell's rows
        found = [r["prompt_tokens"] for r in rows(stage) if r["method"] == cell.replace(" (no budget)", "")]
        return f"{sum(found) / len(found):.0f}"
    cells = summary(stage)
    row, full = cells[cell], cells["full"]
    if name == "prompt":
        return row["prompt"] or PROMPT_WITHOUT_BUDGET[cell]
    if name not in FIELDS:
        raise KeyError(f"unknown field {name!r}; known: {', '.join(FIELDS)}")
    return FIELDS[name](row, full)


FIELDS = {
    "correct": lambda r, f: f"{r['correct']}/{r['n']}",
    "ci": lambda r, f: f"{float(r['ci_low']):.2f}-{float(r['ci_high']):.2f}",
    "lost": lambda r, f: r["lost"],
    "gained": lambda r, f: r["gained"],
    "p": lambda r, f: p_text(r["paired_p"]),
    "holm": lambda r, f: p_text(r["paired_p_holm"]),
    "vsfull": lambda r, f: versus(r, "full"),
    "vsrandom": lambda r, f: versus(r, "random"),
    "random_lost": lambda r, f: r["random_lost"],
    "random_gained": lambda r, f: r["random_gained"],
    "random_p": lambda r, f: p_text(r["random_p"]),
    "random_holm": lambda r, f: p_text(r["random_p_holm"]),
    "diff": lambda r, f: (f"{points(float(r['diff_vs_full']))} ({points(float(r['diff_low']))} to "
                          f"{points(float(r['diff_high']))})" if r["diff_vs_full"] else "-"),
    "eff": lambda r, f: f"{float(r['effective_budget']):.0f}" if r["effective_budget"] else "-",
    "gen": lambda r, f: f"{float(r['mean_generated_tokens']):.0f}",
    "cap": lambda r, f: r["at_cap"],
    "over": lambda r, f: r["over_bound"],
    "toks": lambda r, f: f"{float(r['tokens_per_s']):.1f}",
    "peak": lambda r, f: f"{float(r['peak_live_tokens_per_head']):.0f}",
    "mib": lambda r, f: f"{float(r['peak_kv_mib']):.1f}",
    "xfull": lambda r, f: f"{float(r['peak_kv_mib']) / float(f['peak_kv_mib']):.2f}x",
}


def pair_lines(stage: str) -> list[str]:
    """The lines of the report's table of every two cells."""
    text = (STAGES[stage][0] / "report.md").read_text(encoding="utf-8").split("## Every two cells, paired", 1)[1]
    return [line for line in text.split("\n\n", 2)[2].splitlines() if line.startswith("|")]


def pair(stage: str, a: str, b: str) -> str:
    """``a/b (p; Holm q)`` from the report's table of every two cells: row A, column B."""
    labels = {c: c.replace(" (no budget)", "") if not r["budget"] else f"{r['method']}@{r['budget']}"
              for c, r in summary(stage).items()}
    lines = pair_lines(stage)
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        entries = [c.strip() for c in line.strip("|").split("|")]
        if entries[0] == labels[a]:
            return entries[columns.index(labels[b])].strip("*")
    raise KeyError(f"no row {labels[a]} in stage {stage}'s table of every two cells")


# ------------------------------------------------------------------------------------ tables
STAGE_COLUMNS = ("prompt", "budget", "effective budget", "correct", "95% CI", "vs full: lost/gained (p; Holm)",
                 "vs full: Δ points (95% CI)", "vs random: lost/gained (p; Holm)", "gen mean", "at cap",
                 "peak live/head", "peak KV MiB", "peak KV (x full)")


def stage_table(stage: str) -> str:
    """Every cell of a stage, most accurate first."""
    cells = summary(stage)
    lines = [f"| cell ({STAGES[stage][1]}) | " + " | ".join(STAGE_COLUMNS) + " |",
             "|" + "---|" * (len(STAGE_COLUMNS) + 1)]
    for cell in by_accuracy(cells):
        row = cells[cell]
        values = [field(stage, cell, "prompt"), row["budget"] or "-", field(stage, cell, "eff"),
                  field(stage, cell, "correct"), field(stage, cell, "ci"), field(stage, cell, "vsfull"),
                  field(stage, cell, "diff"), field(stage, cell, "vsrandom"), field(stage, cell, "gen"),
                  field(stage, cell, "cap"), field(stage, cell, "peak"), field(stage, cell, "mib"),
                  field(stage, cell, "xfull")]
        lines.append(f"| {cell} | " + " | ".join(values) + " |")
    return "\n".join(lines)


CHOICE_COLUMNS = ("prompt", "GSM8K correct", "GSM8K vs full: lost/gained (Holm p)", "GSM8K effective budget",
                  "GSM8K peak KV (x full)", "MATH-500 correct", "MATH-500 vs full: lost/gained (Holm p)",
                  "MATH-500 effective budget", "MATH-500 peak KV (x full)")
CHOICE_CAPTION = "GSM8K 0-99 at budget 128, MATH-500 100-149 at budget 256"


def choice_cells() -> list[str]:
    """README's rows, in stage 1's accuracy order: its most accurate cells, every cell that runs a
    method's official defaults (``OFFICIAL``), and the random control."""
    ranked = by_accuracy(summary("1"))
    official = [c for c in ranked if c.endswith(OFFICIAL)]
    chosen = [c for c in ranked if c != "random" and c not in official][:CHOICE_ROWS - 1 - len(official)]
    return [c for c in ranked if c in chosen or c in official or c == "random"]


def short_versus(stage: str, cell: str) -> str:
    """``lost/gained (Holm p)`` against full, "-" for full itself."""
    row = summary(stage)[cell]
    return f"{row['lost']}/{row['gained']} ({p_text(row['paired_p_holm'])})" if row["lost"] else "-"


def choice_table() -> str:
    later = summary("2")
    lines = [f"| cell ({CHOICE_CAPTION}) | " + " | ".join(CHOICE_COLUMNS) + " |", "|" + "---|" * (len(CHOICE_COLUMNS) + 1)]
    for cell in choice_cells():
        values = [field("1", cell, "prompt")] + [
            value for stage in "12" for value in
            ([field(stage, cell, "correct"), short_versus(stage, cell), field(stage, cell, "eff"), field(stage, cell, "xfull")]
             if stage == "1" or cell in later else ["-"] * 4)]
        lines.append(f"| {cell} | " + " | ".join(values) + " |")
    return "\n".join(lines)


TABLES = {"choice": choice_table, "stage1": lambda: stage_table("1"), "stage2": lambda: stage_table("2")}
BLOCK = re.compile(r"(<!-- grid:(\w+) -->\n)(.*?)(<!-- /grid:\2 -->)", re.S)
FIGURE = re.compile(r"(<!--g (\d) (.+?) (\w+)-->)(.*?)(<!--/g-->)")


def refresh(text: str) -> str:
    """``text`` with every generated table and figure rewritten from the CSVs and reports."""
    text = BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4), text)

    def figure(m: re.Match) -> str:
        stage, cell, name = m.group(2), m.group(3), m.group(4)
        value = pair(stage, *cell.split("~")) if name == "pair" else field(stage, cell, name)
        return m.group(1) + value + m.group(6)

    return FIGURE.sub(figure, text)


def main(argv: list[str]) -> int:
    stale = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        new = refresh(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if "--check" not in argv:
                path.write_text(new, encoding="utf-8")
    if stale:
        print(("stale: " if "--check" in argv else "rewrote: ") + ", ".join(map(str, stale)))
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
