"""Issue 50: when files and disks fail, one clear line naming the file and the fix; nothing lost,
nothing mixed.  No test here decodes with the bundled model: the grids run a random two-layer
model over byte tokens in a fraction of a second, and the CLI tests fail before any model loads."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from kvsieve import files
from kvsieve.checks import InputError
from kvsieve.cli import app
from kvsieve.eval import EvalConfig, ResultStore, run_grid, write_report
from kvsieve.eval.runner import LogLines, progress_reporter
from kvsieve.eval.store import check_manifest
from kvsieve.files import OutputError
from kvsieve.random_models import ByteTokenizer

runner = CliRunner()
GSM = [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in [(2, 3), (4, 4), (7, 1)]]


def one_line(*args) -> tuple[int, str]:
    """``kvsieve ARGS``: its exit code and its error as one line (rich boxes it), checked to have no traceback."""
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    text = " ".join(result.output.replace("│", " ").split())
    return result.exit_code, text


def error_of(*args) -> str:
    """The one line of a refused ``kvsieve ARGS``: a usage error's (exit 2, in rich's box) or a file
    error's (exit 1, ``error: ...``)."""
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 1:
        lines = result.output.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
        return lines[0].removeprefix("error: ")
    text = " ".join(result.output.replace("│", " ").split())
    return text[text.index("Invalid value: ") + len("Invalid value: "):].split(" ╰")[0]


@pytest.fixture
def gsm(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM), encoding="utf-8")
    return path


def eval_args(data, out, *extra):
    return ["eval", "--model", "smollm2-135m", "--dataset", "gsm8k", "--data", data, "--out", out,
            "--max-new-tokens", "3", "--no-progress", *extra]


# ---------------------------------------------------------------------------- a tiny model on disk
class ChatBytes(ByteTokenizer):
    """ByteTokenizer with a chat template: the messages' texts, joined, as bytes."""

    chat_template = "bytes"

    def apply_chat_template(self, messages, **_):
        return list("".join(m["content"] for m in messages).encode())


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=258,
                                  max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = ByteTokenizer.eos_token_id
    return model


def tiny_config(model_dir, out, data, **fields) -> EvalConfig:
    return EvalConfig(model=str(model_dir), dataset="gsm8k", out=str(out), data_path=str(data), max_new_tokens=3,
                      methods=("tova",), budgets=(8,), batch_size=2, **fields)


# ---------------------------------------------------------------------------- 1. silent wrong results
def test_triattention_statistics_with_nan_or_inf_are_refused_when_read(tmp_path):
    from kvsieve.methods.triattention import QueryStats

    q_mean = torch.randn(2, 4, 4, 2)
    stats = QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1), inv_freq=torch.ones(4, dtype=torch.float64),
                       attention_scaling=1.0, num_kv_heads=2, model_name="m", fingerprint={})
    stats.q_abs_mean[0, 1, 2] = float("nan")
    stats.q_abs_mean[1, 0, 0] = float("inf")
    torch.save({"kind": "kvsieve-triattention-stats", **vars(stats)}, tmp_path / "nan.pt")  # as save, unchecked
    with pytest.raises(ValueError) as err:
        QueryStats.read(tmp_path / "nan.pt")
    assert str(err.value) == (f"{tmp_path / 'nan.pt'}: TriAttention statistics have 2 of 32 values in q_abs_mean that "
                              "are not finite (nan or inf); calibrate again (make one with: kvsieve calibrate "
                              "triattention --model MODEL --data FILE --out stats.pt)")
    with pytest.raises(ValueError, match="nan.pt: TriAttention statistics have 2 of 32 values"):  # through the method
        from kvsieve.methods import make_policy

        make_policy("triattention", 16, stats=str(tmp_path / "nan.pt"))


def test_triattention_statistics_of_other_layer_and_head_counts_are_refused_before_decoding(tmp_path):
    from kvsieve import GenerateConfig, generate
    from kvsieve.methods import make_policy
    from kvsieve.methods.triattention import QueryStats, StatsModelError
    from kvsieve.model_files import model_fingerprint, model_name

    model = tiny_model()
    q_mean = torch.randn(1, 4, 4, 2)  # 1 layer: the model has 2
    QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1), inv_freq=torch.ones(4, dtype=torch.float64),
               attention_scaling=1.0, num_kv_heads=2, model_name=model_name(model),
               fingerprint=model_fingerprint(model)).save(tmp_path / "one-layer.pt")
    decoded = []
    with pytest.raises(StatsModelError) as err:
        generate(model, ChatBytes(), ["hello"], make_policy("triattention", 4, stats=str(tmp_path / "one-layer.pt")),
                 GenerateConfig(max_new_tokens=3), on_token=lambda row, ids: decoded.append(ids))
    assert str(err.value) == (f"TriAttention statistics {tmp_path / 'one-layer.pt'} hold 1 layers, 4 query heads, 2 kv "
                              "heads, head dim 8; the model has 2 layers, 4 query heads, 2 kv heads, head dim 8; "
                              "calibrate this model (kvsieve calibrate triattention --model ...)")
    assert decoded == []  # refused before any token


def test_a_model_replaced_in_place_is_refused_naming_both_fingerprints(tmp_path, gsm):
    model_dir = tmp_path / "model"
    first = tiny_model(seed=0)
    first.save_pretrained(model_dir)
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, gsm, limit=2)
    run_grid(config, first, ChatBytes(), progress=False)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    recorded = json.loads((out / "run.json").read_text())["model_fingerprint"]
    assert recorded == config.model_fingerprint and {json.dumps(r["model_fingerprint"]) for r in rows} == \
        {json.dumps(recorded)}
    second = tiny_model(seed=1)
    second.save_pretrained(model_dir)  # the same --model path, other weights
    now = tiny_config(model_dir, out, gsm)  # one more sample: there is work to resume
    assert now.model_fingerprint["config_sha256"] == recorded["config_sha256"]
    assert now.model_fingerprint["weights_sha256"] != recorded["weights_sha256"]
    expected = (f"{out}: --model {model_dir} is not the model its rows were made with (replaced in place?): WHERE "
                f"records weights_sha256 {recorded['weights_sha256']} there, {now.model_fingerprint['weights_sha256']} "
                f"now; weights_sha256_whole {recorded['weights_sha256_whole']} there, "
                f"{now.model_fingerprint['weights_sha256_whole']} now; use another --out directory, or the model the "
                "rows were made with")
    with pytest.raises(InputError) as err:
        run_grid(now, second, ChatBytes(), progress=False)
    assert str(err.value) == expected.replace("WHERE", "run.json")
    (out / "run.json").unlink()  # the rows still know
    with pytest.raises(InputError) as err:
        run_grid(tiny_config(model_dir, out, gsm), second, ChatBytes(), progress=False)
    assert str(err.value) == expected.replace("WHERE", "its rows")
    first.save_pretrained(model_dir)  # the model put back (new mtimes, the same bytes): resumes
    run_grid(tiny_config(model_dir, out, gsm), first, ChatBytes(), progress=False)
    assert len((out / "results.jsonl").read_text().splitlines()) == 6


def test_a_manifest_from_before_fingerprints_takes_one_and_resumes(tmp_path, gsm):
    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    fields = tiny_config(model_dir, tmp_path, gsm).result_fields()
    check_manifest(tmp_path, {k: v for k, v in fields.items() if k != "model_fingerprint"})
    check_manifest(tmp_path, fields)
    assert json.loads((tmp_path / "run.json").read_text())["model_fingerprint"] == fields["model_fingerprint"]


def test_calibrate_refuses_to_overwrite_through_a_link_a_file_that_is_no_statistics(tmp_path, monkeypatch):
    import kvsieve.models

    monkeypatch.setattr(kvsieve.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    precious = tmp_path / "notes.txt"
    precious.write_text("my notes\n")
    link = tmp_path / "stats.pt"
    link.symlink_to(precious)
    assert error_of("calibrate", "triattention", "--out", link, "--data", tmp_path / "x.txt") == (
        f"--out {link} (a link to {precious}) exists and is not a TriAttention statistics file; choose another --out, "
        "or pass --force to overwrite it")
    assert precious.read_text() == "my notes\n"
    # --force, or a statistics file behind the link: written where the link points, the link kept
    assert files.check_output_file(link, force=True) == precious
    from kvsieve.methods.triattention import QueryStats

    q_mean = torch.randn(1, 2, 2, 2)
    QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1), inv_freq=torch.ones(2, dtype=torch.float64),
               attention_scaling=1.0, num_kv_heads=1, model_name="m", fingerprint={}).save(tmp_path / "old.pt")
    link.unlink()
    link.symlink_to(tmp_path / "old.pt")
    assert files.check_output_file(link, ours=lambda p: files.reads(QueryStats.read, p)) == tmp_path / "old.pt"


# ---------------------------------------------------------------------------- 2. files and disks that fail
BAD_ROWS = [
    ('{"id": "1", "dataset": "gsm8k"}', "not a results row (no 'method', 'budget')"),
    ("7", "not a results row (a JSON int, not an object)"),
    ('{"id": "1", "method": "tova", "budget": "16", "correct": true}',
     "not a results row ('budget' is '16', not an integer or null)"),
    ('{"id": "1", "method": "tova", "budget": 16, "correct": true, "generated_tokens": "5"}',
     "not a results row ('generated_tokens' is '5', not a number)"),
    ('{"id": "1", "method": "tova", "budget": 16, "correct": "yes"}',
     "not a results row ('correct' is 'yes', not true, false or null)"),
]


def good_row(sample: str, method: str = "full", budget=None, correct: bool = True) -> str:
    return json.dumps({"id": sample, "method": method, "budget": budget, "correct": correct, "generated_tokens": 4,
                       "prompt_tokens": 10, "kv_heads": 1}) + "\n"


@pytest.mark.parametrize("line,problem", BAD_ROWS)
def test_a_hand_edited_row_is_named_by_line_report_goes_on_eval_refuses(tmp_path, gsm, line, problem):
    results = tmp_path / "results.jsonl"
    results.write_text(good_row("0") + line + "\n" + good_row("1", correct=False))
    expected = f"{results}:2: {problem}; remove or fix that line"
    report = write_report(tmp_path, plots=False)
    assert report.skipped == [expected]
    assert [(s.method, s.n, s.correct) for s in report.summaries] == [("full", 2, 1)]
    code, text = one_line("report", tmp_path, "--no-plots")
    assert code == 0 and f"warning: {expected}; left out of the report" in text
    with pytest.raises(InputError) as err:
        ResultStore(tmp_path)
    assert str(err.value) == expected
    assert error_of(*eval_args(gsm, tmp_path)) == expected


def test_a_full_disk_while_writing_rows_is_one_line_and_keeps_every_row_before(tmp_path, monkeypatch):
    store = ResultStore(tmp_path)
    store.append(json.loads(good_row("0")))
    real_write = os.write

    def full(fd, data):  # the disk fills half way through the second row
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OutputError) as err:
        store.append(json.loads(good_row("1")))
    monkeypatch.undo()
    store.close()
    path = tmp_path / "results.jsonl"
    assert str(err.value) == (f"{path}: the disk is full (No space left on device) while writing a row; free some "
                              "space, then run the same command again: it resumes after the 1 row kept")
    assert path.read_text() == good_row("0")  # the half row is cut off
    with ResultStore(tmp_path) as again:
        assert again.done == {("0", "full", None)}


def test_a_full_disk_is_one_line_at_the_command_line(tmp_path, gsm, monkeypatch):
    import kvsieve.eval.store as store

    def full(path, data, doing="writing it"):
        raise files.output_error(OSError(errno.ENOSPC, "No space left on device"), path, doing)

    monkeypatch.setattr(store, "write_atomic", full)
    assert error_of(*eval_args(gsm, tmp_path / "out")) == (
        f"{tmp_path / 'out' / 'run.json'}: the disk is full (No space left on device) while writing the run's "
        "settings; free some space, then run the same command again")


def test_a_read_only_output_directory_is_refused_before_any_work(tmp_path, gsm, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == read_only and mode & os.W_OK else
                        real_access(path, mode))  # root may write anywhere: the check is what is tested
    assert error_of(*eval_args(gsm, read_only)) == (
        f"--out {read_only}: the directory is not writable (no write permission); make it writable or choose another "
        "output path")
    (read_only / "results.jsonl").write_text(good_row("0"))
    assert error_of("report", read_only, "--no-plots") == (
        f"report directory {read_only}: the directory is not writable (no write permission); make it writable or "
        "choose another output path")


def test_out_naming_an_existing_file_is_refused(tmp_path, gsm):
    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    assert error_of(*eval_args(gsm, taken)) == (
        f"--out {taken} is a file, not a directory; give a directory (it is created if missing)")
    assert taken.read_text() == "x"


class Loaded(Exception):
    """Raised by a stand-in for load_model: the work was about to start."""


def test_calibrate_into_a_missing_directory_makes_it_or_is_refused_before_the_model_runs(tmp_path, monkeypatch):
    import kvsieve.models

    out = tmp_path / "no" / "such" / "stats.pt"

    def load_model(*args, **kwargs):
        assert out.parent.is_dir()  # made before the work starts
        raise Loaded

    monkeypatch.setattr(kvsieve.models, "load_model", load_model)
    data = tmp_path / "book.txt"
    data.write_text("Some text to calibrate on.\n")
    result = runner.invoke(app, ["calibrate", "triattention", "--data", str(data), "--out", str(out)])
    assert isinstance(result.exception, Loaded), result.output
    (tmp_path / "file").write_text("x")
    under_a_file = tmp_path / "file" / "stats.pt"
    assert error_of("calibrate", "triattention", "--data", data, "--out", under_a_file) == (
        f"--out {under_a_file}: its directory {tmp_path / 'file'} is a file, not a directory; choose another --out")


def test_a_file_that_is_no_trace_is_named(tmp_path):
    not_trace = tmp_path / "notes.npz"
    not_trace.write_text("hello\n")
    expected = f"{not_trace} is not a trace file (ValueError); give a trace.npz written by kvsieve analyze trace"
    assert error_of("analyze", "trace", "--from", not_trace, "--out", tmp_path) == expected
    assert error_of("analyze", "retention", not_trace) == expected
    import numpy as np

    np.savez(tmp_path / "other.npz", x=np.ones(3))
    assert error_of("analyze", "retention", tmp_path / "other.npz").startswith(
        f"{tmp_path / 'other.npz'} is not a trace file (KeyError)")


@pytest.mark.parametrize("text,what", [('{"model": "smollm2-135m", "dataset": ', "Expecting value at line 1"),
                                       ("[1, 2]", "a JSON list")])
def test_a_run_json_cut_short_is_named(tmp_path, gsm, text, what):
    (tmp_path / "run.json").write_text(text)
    expected = (f"{tmp_path / 'run.json'}: not the settings record kvsieve eval writes ({what}: cut short or edited); "
                "restore it, or delete it and run the same eval command to write it again")
    assert error_of(*eval_args(gsm, tmp_path)) == expected
    (tmp_path / "results.jsonl").write_text(good_row("0"))
    assert error_of("report", tmp_path, "--no-plots") == expected


# ---------------------------------------------------------------------------- 3. text encodings
def latin1(path: Path, first: str, second: str) -> Path:
    path.write_bytes(first.encode() + second.encode("latin-1"))
    return path


def test_every_text_file_read_says_where_it_is_not_utf8_and_to_save_it_as_utf8(tmp_path):
    from kvsieve.analysis.mri import load_prompts
    from kvsieve.analysis.qk import read_texts
    from kvsieve.data import load_dataset
    from kvsieve.methods.lazy import read_window
    from kvsieve.steering import calibration_prompts

    row = json.dumps(GSM[0]) + "\n"
    jsonl = latin1(tmp_path / "data.jsonl", row, '{"question": "caf\xe9?", "answer": "#### 3"}\n')
    text = latin1(tmp_path / "book.txt", "A first line.\n", "Un caf\xe9.\n")
    column = len('{"question": "caf') + 1
    readers = [
        (lambda: read_texts(text), f"{text}:2: not UTF-8 text (byte 0xe9 at column 7); save the file as UTF-8"),
        (lambda: read_texts(jsonl), f"{jsonl}:2: not UTF-8 text (byte 0xe9 at column {column}); save the file as UTF-8"),
        (lambda: load_prompts(jsonl, 2), f"{jsonl}:2: not UTF-8 text (byte 0xe9 at column {column}); save the file as "
                                         "UTF-8"),
        (lambda: calibration_prompts(2, jsonl), f"{jsonl}:2: not UTF-8 text (byte 0xe9 at column {column}); save the "
                                                "file as UTF-8"),
        (lambda: load_dataset("gsm8k", path=str(jsonl)), f"{jsonl}:2: not UTF-8 text (byte 0xe9 at column {column}); "
                                                         "save the file as UTF-8"),
    ]
    for read, expected in readers:
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value) == expected
    with pytest.raises(ValueError, match=r"data.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\); save the file"):
        read_window(str(jsonl))
    results = tmp_path / "run"
    results.mkdir()
    latin1(results / "results.jsonl", good_row("0"), '{"id": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"results.jsonl:2: not UTF-8 text \(byte 0xe9 at column 12\); save the file"):
        ResultStore(results)


def test_calibrate_on_a_latin1_text_names_the_file_and_line(tmp_path, monkeypatch):
    import kvsieve.models

    monkeypatch.setattr(kvsieve.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    text = latin1(tmp_path / "book.txt", "A first line.\n", "Un caf\xe9.\n")
    assert error_of("calibrate", "triattention", "--data", text, "--out", tmp_path / "s.pt") == (
        f"{text}:2: not UTF-8 text (byte 0xe9 at column 7); save the file as UTF-8")


def test_rows_holding_unicode_line_separators_read_back_whole(tmp_path):
    row = {"id": "0", "method": "full", "budget": None, "text": "a\u2028b\x85c\x1cd"}
    with ResultStore(tmp_path) as store:
        store.append(row)
    with ResultStore(tmp_path) as store:
        assert store.done == {("0", "full", None)}


# ---------------------------------------------------------------------------- 4. progress in a log
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_log_lines_say_the_cell_rows_tokens_per_second_and_time_left():
    cells = [(("full", None), ["a", "b"]), (("tova", 8), ["a", "b"])]
    clock, stream = Clock(), io.StringIO()
    log = LogLines(cells, samples=4, max_new_tokens=100, stream=stream, clock=clock)
    log.start(("full", None))
    assert log.line() == "eval: full 2/4 rows, all cells 4/8 rows, 0.0 tokens/s, time left not known yet"
    clock.now, _ = 10.0, log.tokens(50)
    assert log.line() == "eval: full 2/4 rows, all cells 4/8 rows, 5.0 tokens/s, at most 80 s left"
    clock.now, _ = 20.0, log.rows(("full", None), 2)
    assert log.line() == "eval: full 4/4 rows, all cells 6/8 rows, 2.5 tokens/s, about 20 s left"
    assert stream.getvalue() == "eval: full 2/4 rows, all cells 4/8 rows, 0.0 tokens/s, time left not known yet\n"


def test_a_grid_logging_to_a_file_prints_a_line_at_least_every_period(tmp_path, gsm, monkeypatch):
    import time

    import kvsieve.eval.runner as runner_module

    model_dir = tmp_path / "model"
    model = tiny_model()
    model.save_pretrained(model_dir)
    config = tiny_config(model_dir, tmp_path / "out", gsm)
    stream = io.StringIO()
    assert isinstance(progress_reporter(True, [], 1, config), LogLines)  # pytest's stderr is no terminal

    class Captured(LogLines):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, stream=stream)

    real = runner_module.run_batch

    def slow_batch(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "LogLines", Captured)
    monkeypatch.setattr(runner_module, "LOG_EVERY", 0.05)  # a beat every 0.05 s, and a batch that takes 0.3 s
    monkeypatch.setattr(runner_module, "run_batch", slow_batch)
    run_grid(config, model, ChatBytes(), progress=True)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 8, lines  # 4 batches of 0.3 s, a line each 0.05 s
    assert lines[0] == "eval: full 0/3 rows, all cells 0/6 rows, 0.0 tokens/s, time left not known yet"
    assert lines[-1].startswith("eval: tova@8 3/3 rows, all cells 6/6 rows, ")
