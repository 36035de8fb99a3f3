"""The grid runner, its resumable store, sharding, Ray, perplexity, reports and the CLI."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import typer
from typer.testing import CliRunner

from kvsieve.eval import EvalConfig, ResultStore, load_results, run_grid, summarize, wilson_interval, write_report
from kvsieve.eval.cli import register
from kvsieve.eval.config import parse_list, parse_shard, split_settings
from kvsieve.eval.regrade import regrade
from kvsieve.eval.report import CellSummary, markdown_table, mcnemar_p, table_rows
from kvsieve.eval.store import check_manifest, row_key

GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "#### 7"},
    {"question": "A pen costs 2 dollars. How much do 5 pens cost?", "answer": "#### 10"},
    {"question": "Sam reads 6 pages a day. How many pages in 3 days?", "answer": "#### 18"},
]


@pytest.fixture(scope="module")
def gsm_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM_ROWS), encoding="utf-8")
    return str(path)


def tiny_config(out, data, **overrides) -> EvalConfig:
    fields = dict(model="smollm2-135m", dataset="gsm8k", out=str(out), data_path=data, limit=2, methods=("tova",),
                  budgets=(32,), max_new_tokens=16, batch_size=2)
    return EvalConfig(**{**fields, **overrides})


def keyed(rows):
    return {row_key(r): r for r in rows}


@pytest.fixture(scope="module")
def reference(smollm, gsm_file, tmp_path_factory):
    """One uninterrupted tiny grid: full + tova@32 over two GSM8K-style problems."""
    out = tmp_path_factory.mktemp("reference")
    model, tok = smollm
    run_grid(tiny_config(out, gsm_file), model, tok, progress=False)
    return load_results(out)


# ---------------------------------------------------------------------------- config
def test_cells_run_full_once_first():
    config = EvalConfig(model="m", dataset="gsm8k", out="x", methods=("tova", "full", "h2o"), budgets=(256, 128))
    assert config.cells() == [("full", None), ("tova", 256), ("tova", 128), ("h2o", 256), ("h2o", 128)]


def test_reference_limit_runs_full_on_the_first_samples_only():
    from kvsieve.data import Sample
    from kvsieve.eval.runner import pending_work

    samples = [Sample(id=str(i), messages=[{"role": "user", "content": "q"}], reference="1", grader="gsm8k")
               for i in range(5)]
    config = EvalConfig(model="m", dataset="gsm8k", out="unused", methods=("tova",), budgets=(64,), reference_limit=2)
    work = {cell: [s.id for s in pending] for cell, pending in pending_work(config, samples, {("0", "full", None)})}
    assert work == {("full", None): ["1"], ("tova", 64): ["0", "1", "2", "3", "4"]}
    with pytest.raises(ValueError, match="reference_limit must be >= 1"):
        EvalConfig(model="m", dataset="gsm8k", out="unused", reference_limit=0)


def test_cells_take_wrappers_and_budget_fitted_methods():
    config = EvalConfig(model="m", dataset="gsm8k", out="x", methods=("caote:tova", "lagkv"), budgets=(64,))
    assert config.cells() == [("full", None), ("caote:tova", 64), ("lagkv", 64)]
    with pytest.raises(ValueError, match="unknown method wrapper 'nope'"):
        EvalConfig(model="m", dataset="d", out="x", methods=("nope:tova",))


def test_lagkv_given_its_own_size_runs_once_without_a_budget():
    """A budget would only be fitted to L and r: given them, LagKV is one cell, placed by its peak."""
    config = EvalConfig(model="m", dataset="gsm8k", out="x", methods=("lagkv", "lagkv+grid", "tova"),
                        budgets=(128, 64), settings={"lagkv+grid": {"lag": 128, "ratio": 0.125}})
    assert config.cells() == [("full", None), ("lagkv", 128), ("lagkv", 64), ("lagkv+grid", None), ("tova", 128),
                              ("tova", 64)]


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown method .nope.; choose one of: full"):
        EvalConfig(model="m", dataset="d", out="x", methods=("nope",))
    with pytest.raises(ValueError, match="budgets must be positive"):
        EvalConfig(model="m", dataset="d", out="x", budgets=(0,))
    with pytest.raises(ValueError, match="expects i/n"):
        parse_shard("1")
    with pytest.raises(ValueError, match="need 0 <= i < n"):
        parse_shard("2/2")
    assert parse_shard("1/4") == (1, 4) and parse_list("128, 256", "--budgets", int) == (128, 256)
    with pytest.raises(ValueError, match="list of int"):
        parse_list("12x", "--budgets", int)


def test_split_settings():
    out = split_settings({"recent": 8, "tova.heads": "group"}, ("full", "tova", "h2o"))
    assert out == {"tova": {"recent": 8, "heads": "group"}, "h2o": {"recent": 8}}
    with pytest.raises(ValueError, match="not in --methods"):
        split_settings({"snapkv.window": 4}, ("tova",))


# ---------------------------------------------------------------------------- store
def test_store_appends_resumes_and_never_duplicates(tmp_path):
    with ResultStore(tmp_path) as store:
        assert store.append({"id": "a", "method": "full", "budget": None})
        assert not store.append({"id": "a", "method": "full", "budget": None})
        assert store.append({"id": "a", "method": "tova", "budget": 64})
    with ResultStore(tmp_path) as store:
        assert store.done == {("a", "full", None), ("a", "tova", 64)}
        assert not store.append({"id": "a", "method": "tova", "budget": 64})
    assert len(load_results(tmp_path)) == 2


def test_store_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"id": "a", "method": "full", "budget": None}) + '\n{"id": "b", "meth', encoding="utf-8")
    assert [r["id"] for r in load_results(tmp_path)] == ["a"]  # readers skip it
    with pytest.warns(UserWarning, match="torn last line"):
        store = ResultStore(tmp_path)
    store.append({"id": "b", "method": "full", "budget": None})
    store.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b"]


def test_store_merges_shards_and_rejects_broken_lines(tmp_path):
    (tmp_path / "results.shard0of2.jsonl").write_text(json.dumps({"id": "a", "method": "full", "budget": None}) + "\n")
    (tmp_path / "results.shard1of2.jsonl").write_text(
        json.dumps({"id": "b", "method": "full", "budget": None}) + "\n" + json.dumps({"id": "a", "method": "full", "budget": None}) + "\n")
    with pytest.warns(UserWarning, match="1 duplicate"):
        assert sorted(r["id"] for r in load_results(tmp_path)) == ["a", "b"]
    (tmp_path / "results.jsonl").write_text("garbage\n" + json.dumps({"id": "c", "method": "full", "budget": None}) + "\n")
    with pytest.raises(ValueError, match=r"results\.jsonl:1: not a JSON row"):
        load_results(tmp_path)


def test_a_second_writer_of_the_same_file_fails_at_once(tmp_path):
    with ResultStore(tmp_path):
        with pytest.raises(ValueError, match="being written by another process"):
            ResultStore(tmp_path)
        ResultStore(tmp_path, "results.shard1of2.jsonl").close()  # another shard's file is free
    ResultStore(tmp_path).close()  # closing released the lock


# ---------------------------------------------------------------------------- regrade
def stored_row(key, text, reference, extracted, correct, **extra):
    return {"id": key, "method": "full", "budget": None, "reference": reference, "text": text,
            "extracted": extracted, "correct": correct, **extra}


def test_regrade_lists_changed_rows_and_rewrites_only_when_asked(tmp_path, gsm_file):
    rows = [stored_row("0", "The candle is \\boxed{L - 8} long.", "8", "8", True, grader="gsm8k"),  # old grader's error
            stored_row("1", "So \\boxed{18}.", "18", "18", True),  # written before rows named their grader
            {"id": "2", "method": "full", "budget": None, "nll": 2.0}]  # a perplexity row: no text
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    check_manifest(tmp_path, {"dataset": "gsm8k", "data_path": gsm_file, "data_options": {}, "settings": {}})
    before = path.read_text(encoding="utf-8")

    found = regrade(tmp_path)  # row 1's kind comes from run.json's data set
    assert (found.rows, found.graded) == (3, 2)
    assert [(c.key, c.before, c.after) for c in found.changes] == [(("0", "full", None), ("8", True), ("L - 8", False))]
    assert path.read_text(encoding="utf-8") == before and not found.backups

    found = regrade(tmp_path, write=True)
    assert found.backups[0].read_text(encoding="utf-8") == before
    new = {r["id"]: r for r in load_results(tmp_path)}
    assert (new["0"]["extracted"], new["0"]["correct"]) == ("L - 8", False)
    assert new["1"]["grader"] == "gsm8k" and new["1"]["correct"] and new["2"] == rows[2]
    assert not regrade(tmp_path).changes  # idempotent


def test_regrade_gives_a_truncated_row_no_credit_for_its_last_number(tmp_path):
    cut = "She buys 8 more to get 18 total and then"
    rows = [stored_row("0", cut, "18", "18", True, grader="gsm8k", finish_reason="length"),
            stored_row("1", cut + " stops.", "18", "18", True, grader="gsm8k", finish_reason="eos")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    found = regrade(tmp_path)
    assert [(c.key, c.after) for c in found.changes] == [(("0", "full", None), (None, False))]


def test_regrade_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no results files"):
        regrade(tmp_path)
    (tmp_path / "results.jsonl").write_text(json.dumps(stored_row("0", "\\boxed{1}", "1", "1", True)) + "\n")
    with pytest.raises(ValueError, match="pass --grader"):
        regrade(tmp_path)  # no grader field and no run.json
    assert regrade(tmp_path, grader="gsm8k").graded == 1
    with pytest.raises(ValueError, match="unknown grader 'nope'"):
        regrade(tmp_path, grader="nope")
    with ResultStore(tmp_path):
        assert regrade(tmp_path, grader="gsm8k").graded == 1  # a dry run reads beside a running eval
        with pytest.raises(ValueError, match="being written by another process"):
            regrade(tmp_path, write=True, grader="gsm8k")


def test_manifest_refuses_other_settings(tmp_path):
    check_manifest(tmp_path, {"model": "a", "max_new_tokens": 16})
    check_manifest(tmp_path, {"model": "a", "max_new_tokens": 16})
    with pytest.raises(ValueError, match="max_new_tokens: 16 before, 32 now.*another --out"):
        check_manifest(tmp_path, {"model": "a", "max_new_tokens": 32})


def test_pinned_commit_is_the_checkouts_head_and_refuses_changes(tmp_path):
    from kvsieve.eval.config import source_commit

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    with pytest.raises(ValueError, match="needs kvsieve run from a git checkout"):
        source_commit(tmp_path)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert source_commit(tmp_path) == git("rev-parse", "HEAD")
    (tmp_path / "a.py").write_text("x = 2\n")
    with pytest.raises(ValueError, match="has uncommitted changes; commit them or run from a clean worktree"):
        source_commit(tmp_path)
    check_manifest(tmp_path / "run", {"model": "m", "source_commit": "a" * 40})
    with pytest.raises(ValueError, match="source_commit: 'a{40}' before, 'b{40}' now"):
        check_manifest(tmp_path / "run", {"model": "m", "source_commit": "b" * 40})


def test_manifest_lets_a_grid_grow_by_methods(tmp_path):
    check_manifest(tmp_path, {"model": "a", "settings": {"tova": {}}})
    check_manifest(tmp_path, {"model": "a", "settings": {"snapkv": {"window": 8}}})  # a new method joins
    assert json.loads((tmp_path / "run.json").read_text())["settings"] == {"tova": {}, "snapkv": {"window": 8}}
    with pytest.raises(ValueError, match="settings of tova: {} before, {'heads': 'group'} now"):
        check_manifest(tmp_path, {"model": "a", "settings": {"tova": {"heads": "group"}}})


# ---------------------------------------------------------------------------- the grid on SmolLM2
def test_grid_rows(reference):
    rows = keyed(reference)
    assert set(rows) == {(i, m, b) for i in ("0", "1") for m, b in (("full", None), ("tova", 32))}
    row = rows[("0", "tova", 32)]
    for field in ("settings", "prompt_tokens", "generated_tokens", "text", "extracted", "correct", "peak_kv_tokens",
                  "peak_kv_bytes", "tokens_per_s", "compression_events", "reference", "finish_reason"):
        assert field in row, field
    assert row["settings"]["budget"] == 32 and row["settings"]["method"] == "tova"
    assert 0 < row["generated_tokens"] <= 16 and row["compression_events"] > 0
    assert row["final_kv_tokens"] <= (32 + 1) * row["kv_heads"] < rows[("0", "full", None)]["final_kv_tokens"]
    assert row["final_kv_tokens_mean"] == row["final_kv_tokens"]  # tova: every layer holds the same budget
    assert row["reference"] == "7" and isinstance(row["correct"], bool)
    assert row["grader"] == "gsm8k"  # what a later re-grade of the stored text needs
    import torch, transformers
    assert row["runtime"] == {"device": "cpu", "dtype": "float32", "threads": row["runtime"]["threads"],
                              "torch": torch.__version__, "transformers": transformers.__version__}
    assert row["runtime"]["threads"] >= 1


def test_restart_skips_finished_rows(smollm, gsm_file, reference, tmp_path):
    model, tok = smollm
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reference), encoding="utf-8")
    check_manifest(out, tiny_config(out, gsm_file).result_fields())
    calls = []
    run_grid(tiny_config(out, gsm_file), model, tok, progress=False, on_row=calls.append)
    assert calls == [] and len(load_results(out)) == len(reference)
    with pytest.raises(ValueError, match="other settings"):
        run_grid(tiny_config(out, gsm_file, max_new_tokens=8), model, tok, progress=False)


def test_resume_refuses_samples_whose_prompt_changed(smollm, reference, tmp_path):
    """An edited data file (or template, or generated set) makes an id name another prompt: a
    resumed run refuses instead of mixing rows of two prompts under one id."""
    model, tok = smollm
    edited = tmp_path / "gsm.jsonl"
    edited.write_text("".join(json.dumps(dict(r, question=r["question"] + " Explain.")) + "\n" for r in GSM_ROWS),
                      encoding="utf-8")
    out = tmp_path / "run"
    out.mkdir()
    partial = [r for r in reference if (r["id"], r["method"]) != ("1", "tova")]  # a sample left to run
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in partial), encoding="utf-8")
    assert all(len(r["prompt_sha256"]) == 16 for r in partial)
    with pytest.raises(ValueError, match=r"sample\(s\) 0, 1 whose prompt or reference has changed"):
        run_grid(tiny_config(out, str(edited)), model, tok, progress=False)
    assert len(load_results(out)) == len(partial)  # nothing written


def test_resume_refuses_a_cell_whose_method_settings_changed(smollm, gsm_file, reference, tmp_path):
    """Rows written under another default (here: tova's interval, as if a release changed it) are
    not silently joined by rows under the new one; a finished cell is left alone."""
    model, tok = smollm
    out = tmp_path / "run"
    out.mkdir()
    older = [dict(r, settings={**r["settings"], "interval": 5}) if r["method"] == "tova" else r for r in reference]
    older = [r for r in older if (r["id"], r["method"]) != ("1", "tova")]  # tova@32 still has a sample to run
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in older), encoding="utf-8")
    with pytest.raises(ValueError, match=r"tova@32 interval: 5 before, 1 now.*delete those cells' rows"):
        run_grid(tiny_config(out, gsm_file), model, tok, progress=False)
    assert len(load_results(out)) == len(older)  # nothing written


class Interrupt(Exception):
    pass


def test_interrupted_run_resumes_without_loss_or_duplicates(smollm, gsm_file, reference, tmp_path):
    """Kill test: stop mid-grid (after the first durable row, mid-batch), restart, compare."""
    model, tok = smollm

    def stop(row):
        raise Interrupt

    with pytest.raises(Interrupt):
        run_grid(tiny_config(tmp_path, gsm_file), model, tok, progress=False, on_row=stop)
    assert len(load_results(tmp_path)) == 1
    with open(tmp_path / "results.jsonl", "a") as f:  # and a kill in the middle of a write
        f.write('{"id": "1", "method": "tova", "bud')
    with pytest.warns(UserWarning, match="torn"):
        run_grid(tiny_config(tmp_path, gsm_file), model, tok, progress=False)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len({row_key(json.loads(line)) for line in lines}) == len(reference)
    ours, ref = keyed(load_results(tmp_path)), keyed(reference)
    assert {k: r["text"] for k, r in ours.items()} == {k: r["text"] for k, r in ref.items()}


def test_shards_merge_to_the_single_run(smollm, gsm_file, reference, tmp_path):
    model, tok = smollm
    for i in range(2):  # full only: the merge logic is the same for every cell
        run_grid(tiny_config(tmp_path, gsm_file, methods=("full",), shard=(i, 2)), model, tok, progress=False)
    assert sorted(p.name for p in tmp_path.glob("results*.jsonl")) == ["results.shard0of2.jsonl", "results.shard1of2.jsonl"]
    assert full_texts(load_results(tmp_path)) == full_texts(reference) and len(full_texts(reference)) == 2


def test_writers_fill_disjoint_cells_of_one_directory(smollm, gsm_file, reference, tmp_path):
    """full first, then two writers with one budget each (the grid split by budget across
    processes): every row once, in each writer's own file, the same as the single run."""
    model, tok = smollm
    run_grid(tiny_config(tmp_path, gsm_file, methods=("full",)), model, tok, progress=False)
    for budget in (32, 24):
        run_grid(tiny_config(tmp_path, gsm_file, budgets=(budget,), writer=f"b{budget}"), model, tok, progress=False)
    names = sorted(p.name for p in tmp_path.glob("results*.jsonl"))
    assert names == ["results.b24.jsonl", "results.b32.jsonl", "results.jsonl"]
    assert {row_key(json.loads(line))[1:] for line in (tmp_path / "results.b24.jsonl").read_text().splitlines()} == {("tova", 24)}
    ours = keyed(load_results(tmp_path))
    assert len(ours) == 6 and {k: r["text"] for k, r in ours.items() if k[2] != 24} == {k: r["text"] for k, r in keyed(reference).items()}
    with pytest.raises(ValueError, match="letters, digits"):
        tiny_config(tmp_path, gsm_file, writer="a/b")


def full_texts(rows):
    return {k: r["text"] for k, r in keyed(rows).items() if k[1] == "full"}


@pytest.mark.slow  # starts a local Ray cluster (13 s)
def test_ray_local_cluster_gives_the_same_rows(gsm_file, reference, tmp_path):
    pytest.importorskip("ray")
    config = tiny_config(tmp_path, gsm_file)  # full and an eviction cell (tova@32)
    run_grid(config, progress=False, use_ray=True, ray_address="local", ray_init={"num_cpus": 1})
    same = ("text", "correct", "generated_tokens", "compression_events", "final_kv_tokens", "settings")
    ours, ref = keyed(load_results(tmp_path)), keyed(reference)
    assert {k: [r[f] for f in same] for k, r in ours.items()} == {k: [r[f] for f in same] for k, r in ref.items()}


def test_ray_tasks_ask_for_a_gpu_when_the_cluster_has_one():
    from kvsieve.eval.ray_backend import task_gpus

    assert task_gpus(None, "auto", cluster_gpus=8) == 1.0 and task_gpus(None, "cuda:1", 8) == 1.0
    assert task_gpus(None, "auto", cluster_gpus=0) == 0.0 and task_gpus(None, "cpu", 8) == 0.0
    assert task_gpus(0.25, "auto", 8) == 0.25  # four tasks share a GPU
    with pytest.raises(ValueError, match="--ray-gpus must be >= 0"):
        task_gpus(-1, "auto", 8)


@pytest.mark.slow
def test_killed_process_resumes(gsm_file, tmp_path):
    """SIGKILL a real `python -m kvsieve.eval eval` mid-grid, run it again, check every row once."""
    cmd = [sys.executable, "-m", "kvsieve.eval", "eval", "--model", "smollm2-135m", "--dataset", "gsm8k",
           "--data", gsm_file, "--limit", "3", "--methods", "tova,streaming", "--budgets", "32", "--max-new-tokens", "16",
           "--batch-size", "1", "--out", str(tmp_path), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = tmp_path / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = len(results.read_text().splitlines())
    assert 2 <= written < 9
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    keys = [row_key(json.loads(line)) for line in results.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 9


# ---------------------------------------------------------------------------- perplexity
def test_perplexity_matches_a_plain_forward(smollm):
    import torch

    from kvsieve.eval.perplexity import score_text
    from kvsieve.methods import make_policy

    model, tok = smollm
    text = "The quick brown fox jumps over the lazy dog. " * 4
    ids = torch.tensor([tok(text).input_ids])
    with torch.inference_mode():
        logp = model(ids).logits.float().log_softmax(-1)
    expected = -logp[0, :-1].gather(-1, ids[0, 1:, None]).sum().item()
    full = score_text(model, tok, text)
    assert full.scored_tokens == ids.shape[1] - 1 and full.nll == pytest.approx(expected, rel=1e-4)
    roomy = score_text(model, tok, text, make_policy("streaming", budget=4096))
    assert roomy.nll == pytest.approx(expected, rel=1e-4) and roomy.compression_events == 0
    tight = score_text(model, tok, text, make_policy("streaming", budget=16))
    assert tight.compression_events > 0 and max(tight.final_kv_tokens) <= 17 * model.config.num_key_value_heads
    assert math.isfinite(tight.perplexity) and tight.nll != pytest.approx(expected, rel=1e-4)


def test_text_grid_reports_perplexity(smollm, tmp_path):
    model, tok = smollm
    text = tmp_path / "t.txt"
    text.write_text("Rain falls on the hills and the rivers carry it to the sea. " * 3, encoding="utf-8")
    config = EvalConfig(model="smollm2-135m", dataset="text", out=str(tmp_path / "out"), data_path=str(text),
                        data_options={"chunk_tokens": 40}, methods=("streaming",), budgets=(16,), limit=1)
    run_grid(config, model, tok, progress=False)
    summaries = summarize(load_results(tmp_path / "out"))
    assert [s.label for s in summaries] == ["full", "streaming@16"]
    assert all(s.perplexity and s.accuracy is None for s in summaries)
    assert "perplexity" in markdown_table(summaries)


# ---------------------------------------------------------------------------- reports
def test_wilson_interval():
    low, high = wilson_interval(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert wilson_interval(0, 2)[0] == 0.0 and wilson_interval(2, 2)[1] == 1.0
    assert all(math.isnan(v) for v in wilson_interval(0, 0))


def synthetic_rows():
    rows = []
    for i in range(10):
        base = {"id": str(i), "prompt_tokens": 100, "kv_heads": 2, "tokens_per_s": 10.0}
        rows.append({**base, "method": "full", "budget": None, "correct": i < 8, "generated_tokens": 50 + i,
                     "final_kv_tokens": 2 * (150 + i), "peak_kv_bytes": 2**20 * (2 + i / 10)})
        rows.append({**base, "method": "tova", "budget": 64, "correct": i < 6, "generated_tokens": 60 + 2 * i,
                     "final_kv_tokens": 128, "peak_kv_bytes": 2**20})
        rows.append({**base, "method": "tova", "budget": 128, "correct": i < 8, "generated_tokens": 55,
                     "final_kv_tokens": 256, "peak_kv_bytes": 2**21})
    return rows


def test_summary_numbers():
    full, t64, t128 = summarize(synthetic_rows())
    assert (full.label, t64.label, t128.label) == ("full", "tova@64", "tova@128")
    assert full.accuracy == 0.8 and t64.accuracy == 0.6 and t64.retained == pytest.approx(0.75) and t128.retained == 1.0
    assert t64.mean_generated_tokens == 69 and t64.max_generated_tokens == 78
    assert t128.kv_compression == pytest.approx(155 * 2 / 256) and full.kv_compression == pytest.approx(1.0)
    assert t128.peak_kv_mib == 2.0 and full.max_peak_kv_mib == pytest.approx(2.9)
    # paired with full: tova@64 lost samples 6 and 7 and gained none; p = 2 * (1/2)^2
    assert (t64.lost, t64.gained, t64.paired_p) == (2, 0, 0.5) and (t128.lost, t128.gained, t128.paired_p) == (0, 0, 1.0)
    # Holm over the vs-full column {0.5, 1.0}: 2 x 0.5 = 1, then max(1, 1 x 1.0) = 1
    assert (t64.paired_p_holm, t128.paired_p_holm) == (1.0, 1.0)
    assert full.lost is None and "-2/+0 (0.5; Holm 1)" in markdown_table([full, t64])
    # the budget is the whole bound when the prompt competes; full and no-budget cells have none
    assert (full.effective_budget, t64.effective_budget, t128.effective_budget) == (None, 64, 128)
    # tova@64: 6 both right, 2 lost, none gained, 2 neither: -20 points, an interval that holds 0
    # as McNemar's p of 0.5 says (-0.47 to +0.11)
    assert t64.diff_vs_full == pytest.approx(-0.2) and t64.diff_low < -0.2 < 0 < t64.diff_high


def test_holm_adjustment_against_a_hand_computed_family():
    """Four p-values: sorted 0.005, 0.01, 0.03, 0.04 are multiplied by 4, 3, 2, 1 (0.02, 0.03,
    0.06, 0.04) and made non-decreasing (the last becomes 0.06); results in the input order."""
    from kvsieve.eval.report import holm

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1
    assert holm([0.2]) == [0.2] and holm([]) == []


def test_paired_difference_interval_against_a_hand_computed_case():
    """Newcombe's method 10 on the grid's Expected Attention against full (stage 1): 49 both right,
    4 gained, 8 lost, 39 neither.  By hand: accuracies 0.53 and 0.57, Wilson intervals
    0.43289-0.62489 and 0.47215-0.66267; ad - bc = 1879 > n/2, so phi = (1879 - 50) /
    sqrt(53 * 47 * 57 * 43) = 0.74021; delta^2 = 0.09711^2 - 2 phi 0.09711 0.09267 + 0.09267^2 =
    0.0046960, eps^2 = 0.09489^2 - 2 phi 0.09489 0.09785 + 0.09785^2 = 0.0048323: -0.04 - 0.06853
    and -0.04 + 0.06952."""
    from kvsieve.eval.report import paired_difference_interval

    pairs = [(True, True)] * 49 + [(False, True)] * 4 + [(True, False)] * 8 + [(False, False)] * 39
    difference, low, high = paired_difference_interval(pairs)
    assert difference == pytest.approx(-0.04) and low == pytest.approx(-0.1085, abs=2e-4)
    assert high == pytest.approx(0.0295, abs=2e-4)
    # 0 lost and 4 gained of 50 (stage 2's Expected Attention): exact McNemar p 0.125, and the
    # interval, unlike the Wald interval (0.005 to 0.155), does not exclude 0
    pairs = [(True, True)] * 14 + [(False, True)] * 4 + [(False, False)] * 32
    difference, low, high = paired_difference_interval(pairs)
    assert difference == pytest.approx(0.08) and low < 0 < high
    # no discordant pair: the interval still has width, around 0
    difference, low, high = paired_difference_interval([(True, True)] * 5 + [(False, False)] * 5)
    assert difference == 0 and low < 0 < high


def test_effective_budget_counts_a_kept_prompt():
    rows = [{"id": str(i), "method": "tova", "budget": 64, "correct": True, "prompt_tokens": 100 + 10 * i,
             "settings": {"protect_prompt": True}, "generated_tokens": 5, "peak_kv_bytes": 1} for i in range(3)]
    assert summarize(rows)[0].effective_budget == 64 + 110


def test_at_cap_counts_the_rows_that_ran_to_the_token_limit():
    """Rows that stopped at max_new_tokens (finish_reason "length"), not at EOS or a stop string;
    unknown ("-") for rows that recorded no finish reason."""
    rows = synthetic_rows()
    for row in rows:
        if row["method"] == "tova" and row["budget"] == 64:
            row["finish_reason"] = "length" if int(row["id"]) < 7 else "eos"
        elif row["method"] == "full":
            row["finish_reason"] = "stop" if row["id"] == "0" else "eos"
    full, t64, t128 = summarize(rows)
    assert (full.at_cap, t64.at_cap, t128.at_cap) == (0, 7, None)
    columns, cells = table_rows([full, t64, t128])
    at_cap = columns.index("at cap")
    assert [row[at_cap] for row in cells] == ["0", "7", "-"]


def test_tokens_per_s_is_the_cells_tokens_over_its_batches_decode_time():
    """Two batches run one after the other, rows written as they end: batch A (prefill 10 s from
    t=100) decodes until its last row ends at 40 s, batch B (prefill 5 s from t=151) until 15 s,
    so the machine made 85 tokens in 55 s of decoding, whatever each row's share of the clock."""
    from kvsieve.eval.report import batch_tokens_per_s

    def row(start, prefill, decode, tokens, delay):  # written `delay` s after it ended
        return {"time": start + prefill + decode + delay, "prefill_s": prefill, "decode_s": decode,
                "generated_tokens": tokens, "tokens_per_s": tokens / decode}

    batch_a = [row(100, 10, 20, 10, 0.2), row(100, 10, 40, 30, 0.1)]
    batch_b = [row(151, 5, 10, 20, 0.3), row(151, 5, 15, 25, 0.05)]
    rows = [batch_b[1], batch_a[1], batch_b[0], batch_a[0]]
    assert batch_tokens_per_s(rows) == pytest.approx(85 / 55)
    assert batch_tokens_per_s(batch_a) == pytest.approx(40 / 40)
    # without the clocks (perplexity chunks): the mean of the rows' own rates
    assert batch_tokens_per_s([{"tokens_per_s": 2.0}, {"tokens_per_s": 4.0}]) == 3.0


def test_cells_pair_with_random_at_their_budget_and_say_the_prompts_fate():
    """vs random counts, per shared id, random right and the cell wrong (lost) and the reverse."""
    rows = synthetic_rows()
    for i in range(10):  # random@64 right on 0-2 and 9; tova@64 right on 0-5
        rows.append({"id": str(i), "method": "random", "budget": 64, "correct": i < 3 or i == 9, "prompt_tokens": 100,
                     "generated_tokens": 70, "kv_heads": 2, "final_kv_tokens": 128, "peak_kv_bytes": 2**20})
    for row in rows:
        if row["method"] == "tova" and row["budget"] == 128:
            row["settings"] = {"protect_prompt": True}
    cells = {s.label: s for s in summarize(rows)}
    t64, rnd, t128 = cells["tova@64"], cells["random@64"], cells["tova@128"]
    assert (t64.random_lost, t64.random_gained) == (1, 3) and t64.random_p == pytest.approx(mcnemar_p(1, 3))
    assert rnd.random_lost is None and t128.random_lost is None  # no random cell at 128
    assert (t64.prompt, t128.prompt, cells["full"].prompt) == ("competes", "kept", None)
    columns, table = table_rows([t64, t128])
    assert table[0][columns.index("vs random (p; Holm)")] == "-1/+3 (0.62; Holm 0.62)"  # one comparison: Holm p = p
    assert [row[columns.index("prompt")] for row in table] == ["competes", "kept"]


def test_spread_labels_moves_overlapping_labels_down_until_none_overlap():
    """Label boxes (x0, y0, x1, y1): after the shifts no two overlap (checked pairwise here),
    boxes only move down, the highest stays, boxes that overlap nothing stay, and two identical
    boxes end one box height plus the gap apart."""
    import random

    from kvsieve.eval.plots import spread_labels

    def overlap(a, b):
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    rng = random.Random(0)
    for _ in range(50):
        boxes = []
        for _ in range(rng.randint(1, 15)):
            x, y = rng.uniform(0, 100), rng.uniform(0, 100)
            boxes.append((x, y, x + rng.uniform(10, 60), y + 8))
        shifts = spread_labels(boxes, gap=1.0)
        moved = [(x0, y0 - d, x1, y1 - d) for (x0, y0, x1, y1), d in zip(boxes, shifts)]
        assert all(d >= 0 for d in shifts)
        assert not any(overlap(a, b) for i, a in enumerate(moved) for b in moved[i + 1:])
        assert shifts[max(range(len(boxes)), key=lambda i: boxes[i][3])] == 0  # the highest label stays
        assert spread_labels(moved, gap=0.0) == [0.0] * len(moved)  # labels that do not overlap stay
    assert spread_labels([(0, 0, 10, 8), (0, 0, 10, 8)], gap=1.0) == [0.0, 9.0]


def test_a_one_budget_grid_of_many_methods_is_drawn_as_its_cells_ranked(tmp_path):
    """accuracy_vs_budget of one budget and more methods than ONE_AXES_METHODS: a row per cell,
    best first, named with its prompt fate (a panel per method would show one point each)."""
    from kvsieve.eval.plots import ONE_AXES_METHODS, _pyplot, accuracy_vs_budget, ranked_figure

    right = {f"m{k}": k for k in range(ONE_AXES_METHODS + 1)}  # m_k right on its first k of 10 samples
    rows = [{"id": str(i), "method": m, "budget": 64, "correct": i < k, "kv_heads": 1, "prompt_tokens": 5,
             "settings": {"protect_prompt": k % 2 == 0}} for m, k in right.items() for i in range(10)]
    rows += [{"id": str(i), "method": "full", "budget": None, "correct": i < 7} for i in range(10)]
    for r in rows:
        r.update(peak_kv_bytes=1000, peak_kv_tokens=10, generated_tokens=5, tokens_per_s=1.0)
    summaries = summarize(rows)
    plt = _pyplot()
    fig, ax = ranked_figure(plt, summaries, 64)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    plt.close(fig)
    expected = sorted([(7, "full")] + [(k, f"m{k}@64 ({'kept' if k % 2 == 0 else 'competes'})") for k in right.values()],
                      key=lambda kv: -kv[0])
    assert labels == [label for _, label in expected]
    png = accuracy_vs_budget(summaries, tmp_path / "a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pareto_front_keeps_cells_no_other_beats_on_memory_and_accuracy():
    from kvsieve.eval.plots import pareto_front

    def cell(label, mib, acc):
        return CellSummary(method=label, budget=1, n=10, correct=None, accuracy=acc, ci_low=acc, ci_high=acc,
                           retained=None, mean_generated_tokens=0, max_generated_tokens=0, kv_compression=None,
                           peak_kv_mib=mib, max_peak_kv_mib=mib, tokens_per_s=0)

    cells = [cell("a", 1, 0.2), cell("b", 2, 0.1), cell("c", 2, 0.5), cell("d", 4, 0.5), cell("e", 8, 0.7),
             cell("f", 0.5, 0.2)]
    # brute force: a cell is dominated if another has <= memory and >= accuracy, one strictly
    expected = [c.method for c in cells if not any(
        o.peak_kv_mib <= c.peak_kv_mib and o.accuracy >= c.accuracy and (o.peak_kv_mib, o.accuracy)
        != (c.peak_kv_mib, c.accuracy) for o in cells)]
    assert sorted(c.method for c in pareto_front(cells)) == sorted(expected) == ["c", "e", "f"]


def test_mcnemar_exact_p_values():
    assert mcnemar_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 1) == pytest.approx(2 * (1 + 4) / 16)  # = 0.625
    assert mcnemar_p(1, 3) == mcnemar_p(3, 1) and mcnemar_p(2, 2) == 1.0 and mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(15, 0) == pytest.approx(2 / 2**15)  # 15 of 15 discordant one way: p ~ 6e-5


def test_compression_uses_the_mean_over_layers_when_rows_have_it():
    """Knorm keeps every token in layers 0-1: its largest layer holds all 155 tokens, the mean over
    4 layers (155, 155, 64, 64) is 109.5, and only the mean shows what it saves."""
    row = {"id": "0", "method": "knorm", "budget": 64, "correct": True, "prompt_tokens": 100, "generated_tokens": 55,
           "kv_heads": 2, "final_kv_tokens": 2 * 155, "final_kv_tokens_mean": 2 * 109.5, "peak_kv_bytes": 2**20}
    older = {k: v for k, v in row.items() if k != "final_kv_tokens_mean"}
    assert summarize([row])[0].kv_compression == pytest.approx(155 / 109.5)
    assert summarize([older])[0].kv_compression == pytest.approx(1.0)  # rows from before: largest layer


def test_retained_pairs_samples_with_full():
    rows = [r for r in synthetic_rows() if not (r["method"] == "tova" and r["id"] in {"8", "9"})]
    t64 = summarize(rows)[1]  # full's accuracy on ids 0-7 is 1.0
    assert t64.n == 8 and t64.retained == pytest.approx(0.75)


def test_plots_of_large_grids_draw_a_panel_per_method_and_pool_memory_by_budget(tmp_path):
    from kvsieve.eval.plots import ONE_AXES_METHODS, accuracy_vs_budget, memory_series, panel_methods

    few = synthetic_rows()
    assert panel_methods(summarize(few)) == [["tova"]]  # one axes, a line per method
    many = list(few)
    for k in range(ONE_AXES_METHODS):  # method mK gets K of 10 right at budget 128, 0 at 64
        for i in range(10):
            for budget in (64, 128):
                many.append({**few[0], "id": str(i), "method": f"m{k}", "budget": budget,
                             "correct": budget == 128 and i < k})
    plan = panel_methods(summarize(many))
    # tova (8/10 at 128) first, then m7 .. m0 by accuracy at their largest budget
    assert plan == [["tova"]] + [[f"m{k}"] for k in reversed(range(ONE_AXES_METHODS))]
    png = accuracy_vs_budget(summarize(many), tmp_path / "acc.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the memory plot pools such a grid's methods per budget, full stays its own line
    assert list(memory_series(few)) == ["full", "tova@64", "tova@128"]
    pooled = memory_series(many)
    assert list(pooled) == ["full", f"every method at budget 64 ({ONE_AXES_METHODS + 1} methods)",
                            f"every method at budget 128 ({ONE_AXES_METHODS + 1} methods)"]
    assert len(pooled["full"]) == 10 and sum(map(len, pooled.values())) == len(many)


def test_length_plot_has_a_panel_per_budget_with_full_in_each():
    from kvsieve.eval.plots import length_panels

    rows = synthetic_rows() + [dict(synthetic_rows()[0], method="adaptive", budget=None, generated_tokens=7)]
    panels = length_panels(rows)
    assert list(panels) == ["budget 64", "budget 128", "own size"]
    assert list(panels["budget 64"]) == ["full", "tova"] and list(panels["own size"]) == ["full", "adaptive"]
    assert panels["budget 64"]["tova"] == [60 + 2 * i for i in range(10)] and panels["own size"]["adaptive"] == [7]


def test_side_by_side_table_has_a_column_group_per_budget():
    from kvsieve.eval.report import side_by_side_table

    rows = synthetic_rows()
    # full: 8/10, mean 54.5 tokens; tova@128: 8/10, none lost; tova@64: 6/10, lost samples 6 and 7
    assert side_by_side_table(summarize(rows)).splitlines() == [
        "| method | 128: correct | vs full (p) | KV compr. | gen mean | 64: correct | vs full (p) | KV compr. | gen mean |",
        "|---|---|---|---|---|---|---|---|---|",
        "| full | 8/10 |  | 1.00x | 54 |  |  |  |  |",
        "| tova | 8/10 | -0/+0 (1) | 1.21x | 55 | 6/10 | -2/+0 (0.5) | 2.64x | 69 |"]
    assert side_by_side_table(summarize([r for r in rows if r["budget"] != 64])) is None  # one budget


def test_pairwise_table_pairs_every_two_cells_on_the_samples_both_graded():
    """Entry (A, B) is ``a/b (p)``: A right where B is wrong on a samples, the reverse on b, with
    the exact two-sided binomial p of that split, computed here from its definition."""
    from math import comb

    from kvsieve.eval.report import pairwise_table

    def p_exact(a, b):  # two-sided: both tails of Binomial(a + b, 1/2) at least as extreme
        n, k = a + b, min(a, b)
        return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2**n)

    right = {("full", None): set(range(8)), ("tova", 64): {0, 1}, ("h2o", 64): {1, 2, 3, 4, 5, 6, 7, 8}}
    rows = [{"id": str(i), "method": m, "budget": b, "correct": i in ids} for (m, b), ids in right.items()
            for i in range(10)]
    rows.append({"id": "10", "method": "h2o", "budget": 64, "correct": True})  # a sample only h2o has
    lines = pairwise_table(rows, summarize(rows)).splitlines()
    assert lines[0] == "| | h2o@64 | full | tova@64 |"  # by accuracy: 9/11, 8/10, 2/10
    by_row = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in lines[2:]}
    # Holm over the three pairs: p 0.031 (full/tova), 0.07 (h2o/tova), 1 (h2o/full) -> 0.094, 0.14, 1
    p_ft, p_ht = p_exact(6, 0), p_exact(7, 1)
    assert by_row["full"][0] == f"1/1 ({p_exact(1, 1):.2g}; Holm 1)"  # id 0 for full, id 8 for h2o; id 10 not shared
    assert by_row["full"][2] == f"6/0 ({p_ft:.2g}; Holm {3 * p_ft:.2g})" and p_ft < 0.05 < 3 * p_ft  # ids 2-7
    assert by_row["tova@64"][1] == f"0/6 ({p_ft:.2g}; Holm {3 * p_ft:.2g})"  # not bold: beyond chance only raw
    assert by_row["h2o@64"][2] == f"7/1 ({p_ht:.2g}; Holm {2 * p_ht:.2g})" and p_ht > 0.05  # ids 2-8 vs id 0
    assert [by_row[k][i] for i, k in enumerate(["h2o@64", "full", "tova@64"])] == ["-"] * 3
    assert pairwise_table(rows, summarize(rows), max_cells=2) is None
    only_full = [r for r in rows if r["method"] == "full"]
    assert pairwise_table(only_full, summarize(only_full)) is None


def test_report_files(tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows()))
    check_manifest(tmp_path, {"model": "tiny", "dataset": "gsm8k", "max_new_tokens": 80})
    report = write_report(tmp_path)
    names = sorted(p.name for p in report.files)
    assert names == ["accuracy_vs_budget.png", "accuracy_vs_peak_kv.png", "generated_length.png",
                     "kv_memory_vs_length.png", "report.md", "summary.csv"]
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    md = (tmp_path / "report.md").read_text()
    assert "tiny on gsm8k" in md and "| tova | 64 | 64 | competes | 10 | 0.600 | 0.31-0.83 | 75% |" in md
    assert "## Side by side" in md and "| tova | 8/10 | -0/+0 (1) |" in md
    assert "## Every two cells, paired" in md
    assert "| full | - | 0/0 (1; Holm 1) | 2/0 (0.5; Holm 1) |" in md  # full and tova@128 right on ids 0-7, tova@64 on 0-5
    csv_lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,budget,n,correct,accuracy,ci_low,ci_high,retained") and len(csv_lines) == 4
    with pytest.raises(ValueError, match="no result rows"):
        write_report(tmp_path / "empty")


def test_report_joins_cells_of_another_directory_run_with_the_same_settings(tmp_path):
    """A method run later from its own commit (the grid's stage 4) joins the first directory's table:
    its cells pair with full's rows of the first directory, and the header names both commits."""
    settings = {"model": "tiny", "dataset": "gsm8k", "max_new_tokens": 80}
    main, extra, other = tmp_path / "main", tmp_path / "extra", tmp_path / "other"
    rows = [dict(r, text=f"answer {r['id']}") for r in synthetic_rows()]
    full = [r for r in rows if r["method"] == "full"]
    # every eval directory has its own full: the joined one's (on 6 of the samples) decodes alike
    for path, cells, commit in ((main, full, "a" * 40),
                                (extra, [r for r in rows if r["method"] == "tova"] + full[:6], "b" * 40)):
        path.mkdir()
        (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cells))
        check_manifest(path, {**settings, "source_commit": commit})
    report = write_report(main, plots=False, join=[extra])
    # the same cells and pairings as one directory holding every row (test_summary_numbers)
    assert [s.label for s in report.summaries] == ["full", "tova@64", "tova@128"]
    assert report.summaries[0].n == 10 and (report.summaries[1].lost, report.summaries[1].gained) == (2, 0)
    md = (main / "report.md").read_text()
    assert f"(full): commit {'a' * 12}" in md and f"(tova): commit {'b' * 12}" in md
    assert "has the first directory's text on all 6 samples" in md
    assert not (extra / "report.md").exists()

    with open(extra / "results.jsonl", "a") as f:  # a full that decodes otherwise: no shared table
        f.write(json.dumps(dict(full[7], text="something else")) + "\n")
    with pytest.raises(ValueError, match="full's text in .* differs .* on samples 7"):
        write_report(main, plots=False, join=[extra])
    (extra / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["method"] == "tova"))

    other.mkdir()
    (other / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["method"] == "tova"))
    check_manifest(other, {**settings, "max_new_tokens": 512})
    with pytest.raises(ValueError, match="max_new_tokens differs"):
        write_report(main, plots=False, join=[other])
    with pytest.raises(ValueError, match=r"cell tova@(64|128) is in both"):
        write_report(main, plots=False, join=[extra, extra])


def test_cells_report_peak_live_tokens_per_head_and_mark_cells_that_never_compressed():
    from kvsieve.eval.report import table_rows

    base = {"prompt_tokens": 50, "generated_tokens": 30, "kv_heads": 2, "correct": True}
    rows = [{**base, "id": str(i), "method": "full", "budget": None, "peak_kv_tokens": 160,
             "compression_events": 0} for i in range(2)]
    rows += [{**base, "id": str(i), "method": "tova", "budget": 64, "peak_kv_tokens": 130 + 2 * i,
              "compression_events": 10 * i} for i in range(2)]
    rows += [{**base, "id": str(i), "method": "h2o", "budget": 128, "peak_kv_tokens": 160,
              "compression_events": 0} for i in range(2)]
    full, h2o, tova = summarize(rows)
    assert tova.peak_live_tokens_per_head == pytest.approx(65.5) and full.peak_live_tokens_per_head == 80
    assert tova.compression_events == 5 and tova.compressed_share == 0.5
    columns, cells = table_rows([full, h2o, tova])
    events = {row[0]: row[columns.index("events")] for row in cells}
    assert events == {"full": "0.0 (0%)", "h2o": "never compressed", "tova": "5.0 (50%)"}


def test_common_keeps_only_samples_every_cell_has():
    from kvsieve.eval.report import common_rows

    rows = [{"id": i, "method": "full", "budget": None} for i in range(4)]
    rows += [{"id": i, "method": "tova", "budget": 64} for i in (1, 2, 3)]
    rows += [{"id": i, "method": "h2o", "budget": 64} for i in (0, 2, 3)]
    assert sorted({r["id"] for r in common_rows(rows)}) == [2, 3]
    assert len(common_rows(rows)) == 6


# ---------------------------------------------------------------------------- CLI
def make_app(with_analyze: bool = False) -> typer.Typer:
    app = typer.Typer()
    if with_analyze:
        group = typer.Typer()

        @group.command("mri")
        def mri():
            """placeholder"""

        app.add_typer(group, name="analyze")
    register(app)
    return app


def test_register_joins_an_existing_analyze_group():
    app = make_app(with_analyze=True)
    groups = [g for g in app.registered_groups if g.name == "analyze"]
    assert len(groups) == 1
    assert {c.name for c in groups[0].typer_instance.registered_commands} == {"mri", "trace"}
    assert {g.name for g in make_app().registered_groups} == {"analyze"}


def test_cli_report_and_usage_errors(tmp_path):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows()))
    runner = CliRunner()
    app = make_app()
    result = runner.invoke(app, ["report", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "tova" in result.output and (tmp_path / "report.md").exists()
    result = runner.invoke(app, ["eval", "--model", "smollm2-135m", "--dataset", "gsm8k", "--methods", "nope",
                                 "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "unknown method" in result.output
    result = runner.invoke(app, ["eval", "--model", "smollm2-135m", "--dataset", "gsm8k", "--methods", "tova",
                                 "--set", "tova.bogus=1", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "bogus" in result.output
    result = runner.invoke(app, ["regrade", str(tmp_path), "--grader", "gsm8k"])
    assert result.exit_code == 0 and "rows graded" in result.output, result.output
    result = runner.invoke(app, ["regrade", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no results files" in unboxed(result.output)


def unboxed(output: str) -> str:
    """A CLI error as one line: rich wraps it into a box at the runner's width, and where the lines
    break depends on the length of the temporary path in the message."""
    return " ".join(output.replace("│", " ").split())


# ---------------------------------------------------------------------------- steering (+steer labels)
@pytest.fixture(scope="module")
def steering_files(smollm, tmp_path_factory):
    """A vector for the bundled model, the same values under another name's file, a second vector
    with other values, and one built for another model."""
    import torch

    from kvsieve.steering import SteeringVector, default_layer, model_fingerprint, model_name

    model, _ = smollm
    directory = tmp_path_factory.mktemp("steering")
    g = torch.Generator().manual_seed(0)
    config = model.config

    def save(name, vector, owner=None, fingerprint=None):
        vec = SteeringVector(vector, default_layer(config.num_hidden_layers), owner or model_name(model),
                             fingerprint or model_fingerprint(model), {"direction": "execution_minus_others"})
        vec.save(directory / name)
        return str(directory / name)

    first = torch.randn(config.hidden_size, generator=g)
    return {"a": save("a.pt", first), "a_copy": save("a_copy.pt", first),
            "b": save("b.pt", torch.randn(config.hidden_size, generator=g)),
            "other": save("other.pt", first, "Other-7B", {**model_fingerprint(model), "hidden_size": 3584})}


def test_steered_labels_are_cells_of_their_own(steering_files):
    config = EvalConfig(model="m", dataset="gsm8k", out="x", methods=("skipkv", "skipkv+steer", "full+steer"),
                        budgets=(64,), steering=steering_files["a"])
    assert config.cells() == [("full", None), ("skipkv", 64), ("skipkv+steer", 64), ("full+steer", None)]
    settings = config.result_fields()["settings"]
    assert "steering" not in settings["skipkv"]
    assert settings["skipkv+steer"]["steering"] == settings["full+steer"]["steering"] == config.steering_identity()
    assert settings["skipkv+steer"]["steering"]["alpha0"] == 1.0  # the paper preset for an E - O vector
    with pytest.raises(ValueError, match=r"\['skipkv\+steer'\] need a steering vector: pass --steering FILE"):
        EvalConfig(model="m", dataset="gsm8k", out="x", methods=("skipkv+steer",))
    with pytest.raises(ValueError, match=r"only by methods labelled <method>\+steer"):
        EvalConfig(model="m", dataset="gsm8k", out="x", methods=("skipkv",), steering=steering_files["a"])
    with pytest.raises(ValueError, match="unknown steering setting"):
        EvalConfig(model="m", dataset="gsm8k", out="x", methods=("tova+steer",), steering=steering_files["a"],
                   steering_settings={"strength": 2})
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        EvalConfig(model="m", dataset="gsm8k", out="x", methods=("nope+steer",), steering=steering_files["a"])


def test_settings_of_a_method_reach_its_steered_label():
    out = split_settings({"recent": 8, "tova.heads": "group", "tova+steer.interval": 2},
                         ("full+steer", "tova", "tova+steer"))
    assert out == {"tova": {"recent": 8, "heads": "group"}, "tova+steer": {"recent": 8, "heads": "group", "interval": 2}}
    with pytest.raises(ValueError, match="not in --methods"):
        split_settings({"tova+steer.heads": "group"}, ("tova",))


def test_variant_labels_are_cells_with_their_own_settings():
    """``lazy+protect`` is a cell of its own: the method's settings reach it, its own win over them."""
    config = EvalConfig(model="m", dataset="gsm8k", out="x", methods=("lazy", "lazy+protect", "lagkv+grid"),
                        budgets=(128,),
                        settings=split_settings({"lazy.window": 20, "lazy+protect.protect_prompt": True,
                                                 "lazy+protect.window": 16}, ("lazy", "lazy+protect")))
    assert config.cells() == [("full", None), ("lazy", 128), ("lazy+protect", 128), ("lagkv+grid", 128)]
    assert config.settings == {"lazy": {"window": 20}, "lazy+protect": {"window": 16, "protect_prompt": True}}
    with pytest.raises(ValueError, match="a variant after '\\+' is lower-case letters"):
        EvalConfig(model="m", dataset="gsm8k", out="x", methods=("lazy+Protect!",))


def test_skip_runs_a_held_out_slice(gsm_file):
    from kvsieve.eval.runner import load_samples

    every = [s.id for s in load_samples(tiny_config("x", gsm_file, limit=None))]
    assert len(every) >= 3
    assert [s.id for s in load_samples(tiny_config("x", gsm_file, skip=1, limit=2))] == every[1:3]
    with pytest.raises(ValueError, match=f"--skip {len(every)} passes over all {len(every)} samples"):
        load_samples(tiny_config("x", gsm_file, skip=len(every)))
    with pytest.raises(ValueError, match="skip must be >= 0"):
        tiny_config("x", gsm_file, skip=-1)


def test_a_variant_runs_its_own_policy(smollm, gsm_file, reference, tmp_path):
    """The variant's rows carry its settings; the plain label's rows are the reference grid's."""
    model, tok = smollm
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reference), encoding="utf-8")
    methods = ("tova", "tova+protect")
    config = tiny_config(tmp_path, gsm_file, methods=methods,
                         settings=split_settings({"tova+protect.protect_prompt": True}, methods))
    run_grid(config, model, tok, progress=False)
    rows = keyed(load_results(tmp_path))
    assert rows[("0", "tova+protect", 32)]["settings"]["protect_prompt"] is True
    assert rows[("0", "tova", 32)] == keyed(reference)[("0", "tova", 32)]  # not rerun
    assert rows[("0", "tova+protect", 32)]["peak_kv_tokens"] > rows[("0", "tova", 32)]["peak_kv_tokens"]


def test_manifest_keys_steering_by_vector_content_not_path(steering_files, tmp_path):
    def config(path, **kw):
        return EvalConfig(model="m", dataset="gsm8k", out=str(tmp_path), methods=("tova", "tova+steer"),
                          steering=path, **kw)

    check_manifest(tmp_path, config(steering_files["a"]).result_fields())
    check_manifest(tmp_path, config(steering_files["a_copy"]).result_fields())  # moved file, same vector: resumes
    with pytest.raises(ValueError, match="settings of tova\\+steer"):
        check_manifest(tmp_path, config(steering_files["b"]).result_fields())
    with pytest.raises(ValueError, match="settings of tova\\+steer"):
        check_manifest(tmp_path, config(steering_files["a"], steering_settings={"alpha0": 2.0}).result_fields())


@pytest.mark.slow  # ~9 s; the steering check of eval stays in the default suite (another model's vector)
def test_grid_runs_steered_and_unsteered_rows_side_by_side(smollm, gsm_file, steering_files, tmp_path):
    model, tok = smollm
    zero = tiny_config(tmp_path / "zero", gsm_file, methods=("tova", "tova+steer"), steering=steering_files["a"],
                       steering_settings={"alpha0": 0.0, "gamma": 0.0})
    run_grid(zero, model, tok, progress=False)
    rows = keyed(load_results(zero.out))
    assert set(rows) == {(i, m, b) for i in ("0", "1") for m, b in (("full", None), ("tova", 32), ("tova+steer", 32))}
    for i in ("0", "1"):
        plain, steered = rows[(i, "tova", 32)], rows[(i, "tova+steer", 32)]
        assert "steering" not in plain["settings"] and "steering" not in rows[(i, "full", None)]["settings"]
        assert steered["settings"]["steering"] == zero.steering_identity()
        assert steered["settings"]["method"] == "tova" and steered["text"] == plain["text"]  # strength 0: no change
    labels = [s.label for s in summarize(list(rows.values()))]
    assert labels == ["full", "tova@32", "tova+steer@32"]
    strong = tiny_config(tmp_path / "strong", gsm_file, methods=("tova+steer",), steering=steering_files["a"],
                         steering_settings={"alpha0": 8.0})
    run_grid(strong, model, tok, progress=False)
    steered = keyed(load_results(strong.out))
    assert any(steered[(i, "tova+steer", 32)]["text"] != rows[(i, "tova", 32)]["text"] for i in ("0", "1"))


def test_a_vector_for_another_model_fails_before_any_row(smollm, gsm_file, steering_files, tmp_path):
    from kvsieve.steering import SteeringModelError, model_name

    model, tok = smollm
    config = tiny_config(tmp_path, gsm_file, methods=("tova+steer",), steering=steering_files["other"])
    with pytest.raises(SteeringModelError, match=f"built for Other-7B .* not for {model_name(model)}"):
        run_grid(config, model, tok, progress=False)
    assert load_results(tmp_path) == []


def test_cli_eval_steering_errors_name_the_fix(smollm, gsm_file, steering_files, tmp_path):
    from kvsieve.steering import model_name

    runner, app = CliRunner(), make_app()
    base = ["eval", "--model", "smollm2-135m", "--dataset", "gsm8k", "--data", gsm_file, "--limit", "1",
            "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path)]
    result = runner.invoke(app, [*base, "--methods", "tova+steer"], env={"COLUMNS": "250"})
    assert result.exit_code == 2 and "pass --steering FILE" in " ".join(result.output.split())
    result = runner.invoke(app, [*base, "--methods", "tova+steer", "--steering", steering_files["other"]],
                           env={"COLUMNS": "250"})
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "built for Other-7B" in text and f"not for {model_name(smollm[0])}" in text
    assert load_results(tmp_path) == []
