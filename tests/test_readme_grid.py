"""The README's accuracy table (``## Which method at which budget``) against the grid's committed
``summary.csv``: the table users choose a method from is typed by hand from the report, so every
figure in it is checked here against the rows' summary, not against the report code."""

import csv
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The caption of a README table's first column -> the stage whose summary.csv it reports
# (stage 1's report joins stage 4's cells, stage 2's joins stage 5's).
TABLES = {
    "budget 128, GSM8K 0-99": ROOT / "results/accuracy-grid/stage1-gsm8k-b128/summary.csv",
    "budget 256, MATH-500 100-149": ROOT / "results/accuracy-grid/stage2-math500-b256/summary.csv",
}

# The report gives no prompt fate to a cell without a budget; the README says what happens to it:
# LagKV's partitions compress the prompt with everything else (they cannot set it apart).
PROMPT_WITHOUT_BUDGET = {"full": "-", "lagkv (no budget)": "competes"}


def readme_tables() -> dict[str, list[dict[str, str]]]:
    """README tables whose header starts ``| cell (CAPTION) |``: caption -> rows as column -> text."""
    tables, caption, columns = {}, None, []
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        header = re.match(r"\| cell \((.+?)\) \|", line)
        if header:
            caption, columns = header.group(1), ["cell"] + [c.strip() for c in line.strip("|").split("|")][1:]
            tables[caption] = []
        elif caption and line.startswith("|") and not line.startswith("|---"):
            tables[caption].append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
        elif caption and not line.startswith("|"):
            caption = None
    return tables


def summary_rows(path: Path) -> dict[str, dict[str, str]]:
    """summary.csv by the README's cell name: the method, with " (no budget)" for a self-sized
    method other than full."""
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {(r["method"] + (" (no budget)" if not r["budget"] and r["method"] != "full" else "")): r for r in rows}


def versus(row: dict[str, str], against: str) -> str:
    """``lost/gained (p)`` against ``full`` or ``random`` as the README writes it, or "-" for a
    cell without that pairing."""
    lost, gained, p = ("lost", "gained", "paired_p") if against == "full" else ("random_lost", "random_gained", "random_p")
    return f"{row[lost]}/{row[gained]} ({row[p]})" if row[lost] else "-"


def same_versus(readme: str, summary: str) -> bool:
    """Equal counts, and p equal to the two significant digits the README gives."""
    if "-" in (readme, summary):
        return readme == summary
    (counts_a, p_a), (counts_b, p_b) = (re.match(r"(\d+/\d+) \((.+)\)", text).groups() for text in (readme, summary))
    return counts_a == counts_b and float(p_a) == float(f"{float(p_b):.2g}")


def test_readme_has_the_stage_1_table():
    assert "budget 128, GSM8K 0-99" in readme_tables()


@pytest.mark.parametrize("caption", list(TABLES))
def test_every_figure_of_a_readme_grid_table_is_its_summary_csv(caption):
    table = readme_tables().get(caption)
    if table is None:
        pytest.skip(f"the README has no table for {caption} yet")
    summary = summary_rows(TABLES[caption])
    assert sorted(row["cell"] for row in table) == sorted(summary), "the README lists every cell of the stage, once"
    accuracies = []
    for row in table:
        s = summary[row["cell"]]
        where = f"README, {caption}, {row['cell']}"
        assert row["prompt"] == (s["prompt"] or PROMPT_WITHOUT_BUDGET[row["cell"]]), where
        assert row["correct"] == f"{s['correct']}/{s['n']}", where
        assert row["95% CI"] == f"{float(s['ci_low']):.2f}-{float(s['ci_high']):.2f}", where
        assert same_versus(row["vs full: lost/gained (p)"], versus(s, "full")), where
        assert same_versus(row["vs random: lost/gained (p)"], versus(s, "random")), where
        assert row["gen mean"] == f"{float(s['mean_generated_tokens']):.0f}", where
        assert row["at cap"] == s["at_cap"], where
        assert row["peak live/head"] == f"{float(s['peak_live_tokens_per_head']):.0f}", where
        assert row["peak KV MiB"] == f"{float(s['peak_kv_mib']):.1f}", where
        accuracies.append(int(s["correct"]))
    assert accuracies == sorted(accuracies, reverse=True), "cells in accuracy order, best first"
