"""The accuracy grid's figures in README.md and docs/*.md against the grid's committed
``summary.csv`` (and, for pairs of cells, the report's table of every two cells), and the shape of
the README: at most 250 lines, every relative link resolving.

``scripts/grid_docs.py`` writes those figures; the tests here check that every generated table and
figure is what the CSVs give now, and check each table again column by column from the CSV
itself, without the script's formatting, so that a bug in one does not hide in the other."""

import csv
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = {
    "1": ROOT / "results/accuracy-grid/stage1-gsm8k-b128/summary.csv",
    "2": ROOT / "results/accuracy-grid/stage2-math500-b256/summary.csv",
}
# The caption of a table's first column -> the stage whose summary.csv it reports
# (stage 1's report joins stage 4's cells, stage 2's joins stage 5's).
STAGE_TABLES = {"budget 128, GSM8K 0-99": "1", "budget 256, MATH-500 100-149": "2"}
CHOICE = "GSM8K 0-99 at budget 128, MATH-500 100-149 at budget 256"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

# The report gives no prompt fate to a cell without a budget; the docs say what happens to it:
# LagKV's partitions compress the prompt with everything else (they cannot set it apart).
PROMPT_WITHOUT_BUDGET = {"full": "-", "lagkv (no budget)": "competes"}


def grid_docs():
    spec = importlib.util.spec_from_file_location("grid_docs", ROOT / "scripts/grid_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tables(path: Path) -> dict[str, list[dict[str, str]]]:
    """Tables whose header starts ``| cell (CAPTION) |``: caption -> rows as column -> text."""
    found, caption, columns = {}, None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        header = re.match(r"\| cell \((.+?)\) \|", line)
        if header:
            caption, columns = header.group(1), ["cell"] + [c.strip() for c in line.strip("|").split("|")][1:]
            found[caption] = []
        elif caption and line.startswith("|") and not line.startswith("|---"):
            found[caption].append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
        elif caption and not line.startswith("|"):
            caption = None
    return found


def summary_rows(stage: str) -> dict[str, dict[str, str]]:
    """summary.csv by cell name: the method, with " (no budget)" for a self-sized method other than full."""
    with SUMMARY[stage].open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {(r["method"] + (" (no budget)" if not r["budget"] and r["method"] != "full" else "")): r for r in rows}


def same_p(text: str, value: str) -> bool:
    """A p written to two significant digits."""
    return float(text) == float(f"{float(value):.2g}")


def check_versus(text: str, row: dict[str, str], against: str, where: str, raw: bool = True) -> None:
    """``lost/gained (p; Holm q)`` (``raw``) or ``lost/gained (q)`` against full or random, "-" without."""
    lost, gained, p, q = (("lost", "gained", "paired_p", "paired_p_holm") if against == "full" else
                          ("random_lost", "random_gained", "random_p", "random_p_holm"))
    if not row[lost]:
        assert text == "-", where
        return
    if raw:
        counts, p_text, q_text = re.fullmatch(r"(\d+/\d+) \((\S+); Holm (\S+)\)", text).groups()
        assert same_p(p_text, row[p]), where
    else:
        counts, q_text = re.fullmatch(r"(\d+/\d+) \((\S+)\)", text).groups()
    assert counts == f"{row[lost]}/{row[gained]}" and same_p(q_text, row[q]), where


def check_difference(text: str, row: dict[str, str], where: str) -> None:
    """``Δ (low to high)`` in whole points."""
    if not row["diff_vs_full"]:
        assert text == "-", where
        return
    values = [int(v) for v in re.fullmatch(r"([+-]?\d+) \(([+-]?\d+) to ([+-]?\d+)\)", text).groups()]
    assert values == [round(100 * float(row[k])) for k in ("diff_vs_full", "diff_low", "diff_high")], where


def test_every_generated_table_and_figure_is_what_the_csvs_give():
    """Run ``python scripts/grid_docs.py`` after regenerating the reports to make this pass."""
    module = grid_docs()
    stale = [str(path.relative_to(ROOT)) for path in DOCS
             if module.refresh(path.read_text(encoding="utf-8")) != path.read_text(encoding="utf-8")]
    assert not stale, f"stale grid figures in {stale}: run python scripts/grid_docs.py"


def test_figure_markers_name_known_cells_and_fields():
    """Every ``<!--g ...-->`` marker is filled (an unknown cell or field raises in the script)."""
    module = grid_docs()
    for path in DOCS:
        for marker in module.FIGURE.finditer(path.read_text(encoding="utf-8")):
            assert marker.group(5), f"{path.name}: empty figure {marker.group(1)}"


def test_results_page_has_both_stage_tables_and_readme_the_choice_table():
    assert set(tables(ROOT / "docs/results.md")) >= set(STAGE_TABLES)
    assert CHOICE in tables(ROOT / "README.md")


@pytest.mark.parametrize("caption", list(STAGE_TABLES))
def test_every_figure_of_a_stage_table_is_its_summary_csv(caption):
    stage = STAGE_TABLES[caption]
    table = tables(ROOT / "docs/results.md")[caption]
    summary = summary_rows(stage)
    assert sorted(row["cell"] for row in table) == sorted(summary), "the table lists every cell of the stage, once"
    full = summary["full"]
    accuracies = []
    for row in table:
        s = summary[row["cell"]]
        where = f"docs/results.md, {caption}, {row['cell']}"
        assert row["prompt"] == (s["prompt"] or PROMPT_WITHOUT_BUDGET[row["cell"]]), where
        assert row["budget"] == (s["budget"] or "-"), where
        effective = s["effective_budget"]
        assert row["effective budget"] == (f"{float(effective):.0f}" if effective else "-"), where
        if s["prompt"] == "competes":
            assert float(effective) == float(s["budget"]), where  # the prompt is inside the budget
        elif s["prompt"] == "kept":
            assert float(effective) > float(s["budget"]), where  # budget + the kept prompt
        assert row["correct"] == f"{s['correct']}/{s['n']}", where
        assert row["95% CI"] == f"{float(s['ci_low']):.2f}-{float(s['ci_high']):.2f}", where
        check_versus(row["vs full: lost/gained (p; Holm)"], s, "full", where)
        check_difference(row["vs full: Δ points (95% CI)"], s, where)
        check_versus(row["vs random: lost/gained (p; Holm)"], s, "random", where)
        assert row["gen mean"] == f"{float(s['mean_generated_tokens']):.0f}", where
        assert row["at cap"] == s["at_cap"], where
        assert row["peak live/head"] == f"{float(s['peak_live_tokens_per_head']):.0f}", where
        assert row["peak KV MiB"] == f"{float(s['peak_kv_mib']):.1f}", where
        assert row["peak KV (x full)"] == f"{float(s['peak_kv_mib']) / float(full['peak_kv_mib']):.2f}x", where
        accuracies.append(int(s["correct"]))
    assert accuracies == sorted(accuracies, reverse=True), "cells in accuracy order, best first"


def test_every_figure_of_the_readme_choice_table_is_its_summary_csv():
    table = tables(ROOT / "README.md")[CHOICE]
    assert 2 <= len(table) <= 12, "at most 12 rows"
    one, two = summary_rows("1"), summary_rows("2")
    ranked = sorted(one, key=lambda c: -float(one[c]["accuracy"]))  # stable: ties keep the CSV's order
    cells = [row["cell"] for row in table]
    official = [c for c in ranked if c.endswith("+official")]  # a method as its official code runs it (issue 51)
    top = [c for c in ranked if c != "random" and c not in official][:len(cells) - 1 - len(official)]
    assert cells == [c for c in ranked if c in top or c in official or c == "random"], \
        "stage 1's most accurate cells, the official-default cells and the control"
    for row in table:
        where = f"README, {row['cell']}"
        for stage, summary in (("1", one), ("2", two)):
            name = "GSM8K" if stage == "1" else "MATH-500"
            s = summary.get(row["cell"])
            if s is None:  # not run at this stage (yet)
                assert all(row[f"{name} {c}"] == "-" for c in ("correct", "vs full: lost/gained (Holm p)",
                                                                "effective budget", "peak KV (x full)")), where
                continue
            assert row[f"{name} correct"] == f"{s['correct']}/{s['n']}", where
            check_versus(row[f"{name} vs full: lost/gained (Holm p)"], s, "full", where, raw=False)
            effective = s["effective_budget"]
            assert row[f"{name} effective budget"] == (f"{float(effective):.0f}" if effective else "-"), where
            ratio = float(s["peak_kv_mib"]) / float(summary["full"]["peak_kv_mib"])
            assert row[f"{name} peak KV (x full)"] == f"{ratio:.2f}x", where
        assert row["prompt"] == (one[row["cell"]]["prompt"] or PROMPT_WITHOUT_BUDGET[row["cell"]]), where


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_readme_starts_with_the_two_make_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_slug_follows_github():
    assert slug("Inside transformers' own `generate`") == "inside-transformers-own-generate"
    assert slug("LazyEviction's window: `kvsieve analyze mri`") == "lazyevictions-window-kvsieve-analyze-mri"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert path.name != "README.md" or links, "the README links to docs/"
    for link in links:
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: {link} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{path.name}: {link} has no heading #{anchor}"


def test_moved_sections_are_in_docs():
    """What left the README in issue 51 is in docs/, under these headings."""
    expected = {
        "results.md": ["stage-1-cell-by-cell", "caveats", "how-the-grid-runs"],
        "benchmarks.md": ["compiled-decode-step-kvsieve-bench-compiled"],
        "gpu-check.md": ["the-gpu-check-in-one-command-make-gpu-check"],
        "design.md": ["how-a-token-flows"],
        "methods.md": ["lagkvs-fit-to-a-budget", "the-prompt-column"],
        "analyses.md": ["triattentions-premise-kvsieve-analyze-qk"],
        "usage.md": ["evaluate", "lm-evaluation-harness", "bundled-models", "tests"],
    }
    for name, headings in expected.items():
        assert set(headings) <= anchors(ROOT / "docs" / name), name


def test_stage_2_rkv_memory_note_matches_its_rows():
    """docs/results.md's per-batch memory of R-KV at stage 2 (an interrupted batch of 50, then a
    resumed batch of 25), from the rows themselves."""
    import json

    rows = [json.loads(line) for line in
            (ROOT / "results/accuracy-grid/stage2-math500-b256/results.jsonl").read_text().splitlines() if line]
    rkv = [r for r in rows if r["method"] == "rkv"]
    by_batch = {b: [r["peak_kv_bytes"] / 2**20 for r in rkv if r["batch_size"] == b] for b in (50, 25)}
    if sorted(len(v) for v in by_batch.values()) != [25, 25]:
        pytest.skip("R-KV's stage 2 cell no longer has the two batches (rerun in one batch?)")
    text = " ".join((ROOT / "docs/results.md").read_text(encoding="utf-8").split())
    small, large = (f"{sum(v) / len(v):.1f}" for v in (by_batch[25], by_batch[50]))
    assert f"({small} against {large} MiB a row" in text


def test_pareto_front_in_the_results_is_the_csvs():
    """The cells of stage 1 no other cell beats on both peak KV memory and accuracy, by memory."""
    cells = summary_rows("1")
    point = {c: (float(r["peak_kv_mib"]), int(r["correct"])) for c, r in cells.items()}
    front = sorted((c for c, (mib, right) in point.items()
                    if not any(m <= mib and k >= right and (m, k) != (mib, right) for m, k in point.values())),
                   key=lambda c: point[c][0])
    text = " ".join((ROOT / "docs/results.md").read_text(encoding="utf-8").split())
    assert f"<!--g 1 * pareto-->{', '.join(front)}<!--/g-->" in text
