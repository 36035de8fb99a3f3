"""Retention diagnostics: each definition of kvsieve.analysis.retention on hand-made positions,
the per-trace summary, and the ``kvsieve analyze retention`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from kvsieve.analysis import retention as r
from kvsieve.analysis.trace import Trace


def test_region_wipeout_counts_present_regions_left_without_a_kept_token():
    assert r.region_wipeout(np.arange(64), [0, 1, 40, 41], region=16) == (2, 4)  # regions 1 and 3 wiped
    assert r.region_wipeout(torch.arange(10), torch.arange(10), region=4) == (0, 3)  # tensors work too
    with pytest.raises(ValueError, match="region"):
        r.region_wipeout([1], [1], region=0)


def test_retained_iou_compares_only_positions_that_existed_at_the_previous_event():
    assert r.retained_iou([0, 1, 2, 5, 6], [0, 1, 5, 9, 10], prev_n=8) == pytest.approx(3 / 5)
    assert r.retained_iou([3, 4], [3, 4, 8, 9], prev_n=5) == 1.0  # new tokens do not lower it


def test_proxy_segments_group_kept_runs_and_span_iou():
    assert r.proxy_segments([0, 1, 2, 7, 8, 20], max_gap=1).tolist() == [[0, 2], [7, 8], [20, 20]]
    assert r.proxy_segments([0, 1, 2, 7, 8, 20], max_gap=5).tolist() == [[0, 8], [20, 20]]
    assert r.proxy_segments([], max_gap=3).shape == (0, 2)
    # covered: before {0..4, 10}, after {0, 4, 10} (gap 4 > 2 splits 0 and 4)
    assert r.span_iou([0, 2, 4, 10], [0, 4, 10], prev_n=12, max_gap=2) == pytest.approx(3 / 6)
    assert r.span_iou([0, 2, 4, 10], [0, 4, 10], prev_n=12, max_gap=1) == r.retained_iou([0, 2, 4, 10], [0, 4, 10], 12)


def test_middle_retention_and_profile():
    ends = list(range(10)) + list(range(20, 30))
    assert r.middle_retention(ends, 30) == 0.0 and r.middle_retention(range(30), 30) == 1.0
    assert r.middle_retention([20, 21], 30, start=15) == pytest.approx(2 / 5)  # middle of [15, 30): [20, 25)
    assert r.retention_profile([0, 1, 2, 3, 4], 10, bins=2).tolist() == [1.0, 0.0]
    assert np.isnan(r.middle_retention([0], 1))  # no middle third


def test_prompt_retention_is_the_kept_share_of_the_prompt_positions():
    assert r.prompt_retention([0, 2, 7, 9], 4) == pytest.approx(2 / 4)  # 0 and 2 of [0, 4)
    assert r.prompt_retention(range(10), 4) == 1.0 and r.prompt_retention([5, 6], 4) == 0.0
    assert np.isnan(r.prompt_retention([0], 0))


def test_ngram_repetition_rate():
    assert r.ngram_repetition("a b c a b c".split(), n=2) == pytest.approx(1 - 3 / 5)
    assert r.ngram_repetition([1, 2, 3], n=4) == 0.0 and r.ngram_repetition([7] * 6, n=2) == pytest.approx(0.8)


def hand_trace() -> Trace:
    """One row, one layer, one head, two events; and a second head that keeps everything."""
    t = Trace(meta={"method": "demo", "text": "x y x y x y", "prompt_tokens": 4, "generated_tokens": 16})
    for seen, kept0, kept1 in ((10, [0, 1, 8, 9], list(range(10))), (20, [0, 1, 8, 18, 19], list(range(20)))):
        for head, kept in ((0, kept0), (1, kept1)):
            t.layer.append(0), t.row.append(0), t.seen.append(seen), t.head.append(head)
            t.kept.append(np.array(kept, dtype=np.int32))
    return t


def test_trace_diagnostics_per_event_and_summary():
    out = r.trace_diagnostics(hand_trace(), region=4, max_gap=1)
    head0 = [e for e in out["events"] if e["head"] == 0]
    # event 1: regions {0, 1, 2} present, 1 ([4, 8)) wiped; event 2: present {0, 2, 3, 4}, [12, 16) wiped
    assert [(e["wiped_regions"], e["present_regions"]) for e in head0] == [(1, 3), (1, 4)]
    assert head0[1]["iou"] == pytest.approx(3 / 4) and "iou" not in head0[0]
    assert [e["segments"] for e in head0] == [2, 3]
    s = out["summary"]
    assert s["events"] == 2 and s["records"] == 4
    assert s["wipeout_rate"] == pytest.approx(2 / (3 + 4 + 3 + 5))  # head 1 wipes nothing
    assert s["iou"] == pytest.approx((3 / 4 + 1) / 2)
    assert np.isnan(s["prompt_retention"])  # no prompt length given
    # a 4-token prompt: head 0 keeps {0, 1} of it at both events, head 1 all of it
    s = r.trace_diagnostics(hand_trace(), region=4, max_gap=1, prompt=4)["summary"]
    assert s["prompt_retention"] == pytest.approx((2 / 4 + 2 / 4 + 1 + 1) / 4)
    assert s["prompt_retention_last"] == pytest.approx((2 / 4 + 1) / 2)
    s = r.trace_diagnostics(hand_trace(), region=4, max_gap=1, prompt=10)["summary"]
    # [0, 10): head 0 keeps {0, 1, 8, 9} then {0, 1, 8}; head 1 everything
    assert s["prompt_retention_last"] == pytest.approx((3 / 10 + 1) / 2)


def test_cli_prints_trace_and_results_diagnostics(tmp_path):
    app = typer.Typer()
    with pytest.raises(ValueError, match="no 'analyze' group"):
        r.register(app)
    analyze = typer.Typer()

    @analyze.command("other")
    def other():  # a group with one command would be collapsed by typer
        pass

    app.add_typer(analyze, name="analyze")
    r.register(app)
    trace_path = hand_trace().save(tmp_path / "demo.npz")
    results = tmp_path / "results.jsonl"
    rows = [{"id": i, "method": "tova", "budget": 64, "text": t, "generated_tokens": 10}
            for i, t in enumerate(["a b c d a b c d", "one two three four five"])]
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = CliRunner().invoke(app, ["analyze", "retention", str(trace_path), str(results), "--region", "4",
                                   "--ngram", "2"], env={"COLUMNS": "220"})
    assert out.exit_code == 0, out.output
    wipe = 100 * 2 / 15
    assert "demo" in out.output and f"{wipe:.3g}" in out.output
    assert "tova @ 64" in out.output
    rep = 100 * np.mean([1 - 4 / 7, 0.0])
    assert f"{rep:.3g}" in out.output
    assert "prompt kept" in out.output and "0.75" in out.output  # the demo trace's 4-token prompt, last events
