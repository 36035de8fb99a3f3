"""Issue 60, the command line: what the probes of ``scripts/input_probes.py`` found, each with the
exact line the user sees.

* ``report`` on a cell of 0 (or all) correct answers writes its files (the Wilson bound rounded
  past the estimate and made an error bar negative), and a hand-edited row is still named;
* ``eval`` on a finished grid whose data file changed refuses, as it does halfway through;
* the model fingerprint hashes every weight byte: one byte changed between the sampled MiBs is
  caught (the digest of each file is cached by its size, times and inode);
* ``calibrate`` onto a full disk: one line, and no file left behind.

No test here decodes: grids are rows written by hand, or a random two-layer model run by
``run_grid`` in a fraction of a second (``test_files``' tiny model)."""

from __future__ import annotations

import csv
import errno
import hashlib
import io
import json
import os
import time
from pathlib import Path

import pytest

from kvsieve import models
from kvsieve.eval import EvalConfig, run_grid, write_report
from kvsieve.eval.report import wilson_interval
from kvsieve.eval.runner import check_run_manifest
from kvsieve.files import OutputError, write_atomic
from test_files import GSM, ChatBytes, error_of, one_line, tiny_config, tiny_model


# ---------------------------------------------------------------------------- report: 0 and all correct
def test_the_wilson_interval_holds_its_estimate_and_ends_at_0_and_1_exactly():
    """In floating point the bounds for 0/3 came out 5.6e-17 and for 4/4 just below 1: past the
    estimate, which no interval may be."""
    for n in range(1, 201):
        for correct in range(n + 1):
            low, high = wilson_interval(correct, n)
            assert 0.0 <= low <= correct / n <= high <= 1.0, (correct, n, low, high)
        assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0, n


def row(sample: int, method: str, budget, correct: bool) -> dict:
    return {"id": str(sample), "method": method, "budget": budget, "correct": correct, "generated_tokens": 4 + sample,
            "prompt_tokens": 10, "kv_heads": 1, "peak_kv_bytes": 2**20 * (1 + sample), "tokens_per_s": 5.0}


def none_and_all_right(directory: Path, extra_line: str = "") -> Path:
    """A results directory whose full got 4 of 4 right and tova@16 0 of 3: the two counts whose
    Wilson bounds rounded past the estimate (``extra_line``: a hand-edited line after the rows)."""
    rows = [row(i, "full", None, True) for i in range(4)] + [row(i, "tova", 16, False) for i in range(3)]
    path = directory / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra_line)
    return path


def test_report_writes_every_file_for_cells_of_no_and_of_all_right_answers(tmp_path):
    none_and_all_right(tmp_path)
    report = write_report(tmp_path)
    assert sorted(p.name for p in report.files) == ["accuracy_vs_budget.png", "accuracy_vs_peak_kv.png",
                                                    "generated_length.png", "kv_memory_vs_length.png", "report.md",
                                                    "summary.csv"]
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "summary.csv", newline="") as f:
        cells = {(r["method"], r["budget"]): r for r in csv.DictReader(f)}
    assert (cells["full", ""]["accuracy"], cells["full", ""]["ci_high"]) == ("1.0", "1.0")
    assert (cells["tova", "16"]["accuracy"], cells["tova", "16"]["ci_low"]) == ("0.0", "0.0")
    md = (tmp_path / "report.md").read_text()
    assert "| full | none | - | - | 4 | 1.000 | 0.51-1.00 |" in md  # Wilson 4/4: 0.5101-1
    assert "| tova | 16 | 16 | competes | 3 | 0.000 | 0.00-0.56 |" in md  # Wilson 0/3: 0-0.5615


def test_report_on_a_cell_of_no_right_answers_names_a_hand_edited_line_and_writes_its_files(tmp_path):
    """It used to stop at "'yerr' must not contain negative values" before the warning."""
    results = none_and_all_right(tmp_path, extra_line="7\n")
    result = one_line("report", tmp_path)
    assert result[0] == 0, result[1]
    assert result[1].startswith(f"warning: {results}:8: not a results row (a JSON int, not an object); remove or fix "
                                "that line; left out of the report ")
    assert (tmp_path / "report.md").exists() and (tmp_path / "accuracy_vs_peak_kv.png").exists()


# ---------------------------------------------------------------------------- eval: a finished grid, its data edited
def edited_line(out: Path) -> str:
    """The refusal of a grid in ``out`` whose three samples' prompts changed since its rows."""
    return (f"{out} has rows for sample(s) 0, 1, 2 whose prompt or reference has changed since (data file, prompt "
            "template or generated data set); use another --out directory to run them as they are now, or the data "
            "the rows were made from")


def tiny_eval_args(model_dir: Path, data: Path, out: Path) -> list:
    """``kvsieve eval`` as ``test_files.tiny_config`` runs it."""
    return ["eval", "--model", model_dir, "--dataset", "gsm8k", "--data", data, "--out", out, "--methods", "tova",
            "--budgets", "8", "--max-new-tokens", "3", "--batch-size", "2", "--no-progress"]


@pytest.fixture
def finished(tmp_path):
    """A finished grid (full and tova@8 on 3 samples) of a random model saved in ``tmp_path/model``,
    its data file ``tmp_path/gsm.jsonl``: (model directory, data file, results directory)."""
    model_dir, data, out = tmp_path / "model", tmp_path / "gsm.jsonl", tmp_path / "out"
    model = tiny_model()
    model.save_pretrained(model_dir)
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    run_grid(tiny_config(model_dir, out, data), model, ChatBytes(), progress=False)
    return model_dir, data, out


def test_a_finished_grid_whose_data_file_changed_is_refused_until_the_user_chooses(finished, tmp_path):
    """It used to exit 0 and print the old table as if made from the new data; the same edit
    halfway through was refused.  The choices: another --out, or the data the rows were made from."""
    model_dir, data, out = finished
    rows = (out / "results.jsonl").read_text()
    original = data.read_text()
    data.write_text("".join(json.dumps({**r, "question": r["question"] + " Explain."}) + "\n" for r in GSM))
    assert error_of(*tiny_eval_args(model_dir, data, out)) == edited_line(out)
    assert (out / "results.jsonl").read_text() == rows  # nothing written
    (out / "results.jsonl").write_text("".join(rows.splitlines(keepends=True)[:-1]))  # halfway: the same line
    assert error_of(*tiny_eval_args(model_dir, data, out)) == edited_line(out)
    # another --out runs the grid on the data as it is now
    run_grid(tiny_config(model_dir, tmp_path / "new", data), tiny_model(), ChatBytes(), progress=False)
    assert len((tmp_path / "new" / "results.jsonl").read_text().splitlines()) == 6
    data.write_text(original)  # the data the rows were made from: the grid goes on, and its table is shown
    run_grid(tiny_config(model_dir, out, data), tiny_model(), ChatBytes(), progress=False)
    assert len((out / "results.jsonl").read_text().splitlines()) == 6
    code, text = one_line(*tiny_eval_args(model_dir, data, out))
    assert code == 0 and text.endswith(f"rows in {out / 'results.jsonl'}; write the report with: kvsieve report {out}")


# ---------------------------------------------------------------------------- the fingerprint: every weight byte
MIB = 1 << 20


def fake_checkpoint(directory: Path, size: int = 8 * MIB) -> Path:
    """A checkpoint directory whose weights file holds ``size`` random bytes (the fingerprint reads
    bytes, not tensors); returns the weights file."""
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    weights = directory / "model.safetensors"
    weights.write_bytes(os.urandom(size))
    return weights


def change_one_byte(path: Path, offset: int) -> None:
    """Flip the byte at ``offset`` in place, then put the file's times back (as ``cp -p`` would)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def whole_sha256(weights: Path) -> str:
    """The documented ``weights_sha256_whole`` of a one-file checkpoint, computed here by hand."""
    data = weights.read_bytes()
    line = f"{weights.name}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\0"
    return hashlib.sha256(line.encode()).hexdigest()[:16]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty KVSIEVE_CACHE of the test's own (where the weight digests are cached)."""
    monkeypatch.setenv("KVSIEVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_one_byte_changed_between_the_sampled_mibs_changes_the_fingerprint(tmp_path, cache):
    """The byte at 2 MiB + 17 of an 8 MiB file lies outside its first, middle and last MiB: the
    sampled hash (all that fingerprints held before) cannot see it, the whole one does."""
    weights = fake_checkpoint(tmp_path / "model")
    before = models.checkpoint_fingerprint(str(tmp_path / "model"))
    assert before["weights_sha256_whole"] == whole_sha256(weights) and before["weights_bytes"] == 8 * MIB
    change_one_byte(weights, 2 * MIB + 17)
    after = models.checkpoint_fingerprint(str(tmp_path / "model"))
    assert after["weights_sha256"] == before["weights_sha256"]  # the gap that let two models mix
    assert after["weights_sha256_whole"] == whole_sha256(weights) != before["weights_sha256_whole"]


def test_weight_digests_are_cached_by_size_times_and_inode(tmp_path, cache, monkeypatch):
    import kvsieve.files

    weights = fake_checkpoint(tmp_path / "model", size=MIB)
    hashed = []
    real = kvsieve.files.file_digest
    monkeypatch.setattr(kvsieve.files, "file_digest", lambda path: hashed.append(path) or real(path))
    models.weights_digests([weights])
    models.weights_digests([weights])
    assert len(hashed) == 2  # written just now: not cached, its times may not move at the next write
    monkeypatch.setattr(models, "FRESH_NS", 0)  # as if written long ago
    first = models.weights_digests([weights])[weights]
    assert models.weights_digests([weights])[weights] == first and len(hashed) == 3  # read from the cache
    assert str(weights.resolve()) in json.loads((cache / models.DIGESTS).read_text())
    time.sleep(0.05)  # past the file system's timestamp granularity
    change_one_byte(weights, MIB // 3)  # same size, same modification time: its change time moved
    assert models.weights_digests([weights])[weights] == hashlib.sha256(weights.read_bytes()).hexdigest() != first


def test_a_cache_that_cannot_be_read_or_written_is_ignored(tmp_path, cache):
    weights = fake_checkpoint(tmp_path / "model", size=1000)
    cache.mkdir()
    (cache / models.DIGESTS).write_text("{not json")
    assert models.weights_digests([weights]) == {weights: hashlib.sha256(weights.read_bytes()).hexdigest()}


def test_eval_refuses_a_model_changed_between_the_sampled_mibs_naming_the_whole_hash(tmp_path, cache, monkeypatch):
    """Before, the rows of both models were mixed under one fingerprint."""
    weights = fake_checkpoint(tmp_path / "model")
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    out = tmp_path / "out"
    check_run_manifest(tiny_config(tmp_path / "model", out, data))
    recorded = json.loads((out / "run.json").read_text())["model_fingerprint"]["weights_sha256_whole"]
    change_one_byte(weights, 2 * MIB + 17)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert error_of(*tiny_eval_args(tmp_path / "model", data, out)) == (
        f"{out}: --model {tmp_path / 'model'} is not the model its rows were made with (replaced in place?): run.json "
        f"records weights_sha256_whole {recorded} there, {whole_sha256(weights)} now; use another --out directory, "
        "or the model the rows were made with")


def test_a_run_json_from_before_the_whole_hash_resumes_and_takes_it(tmp_path, cache):
    """Directories recorded the sampled hash only (the accuracy grid's): the same model is judged on
    the fields both records hold, and run.json takes the whole hash."""
    fake_checkpoint(tmp_path / "model")
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    config = tiny_config(tmp_path / "model", tmp_path / "out", data)
    fields = config.result_fields()
    older = {**fields, "model_fingerprint": {k: v for k, v in fields["model_fingerprint"].items()
                                             if k != "weights_sha256_whole"}}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text(json.dumps(older))
    check_run_manifest(config)
    assert json.loads((tmp_path / "out" / "run.json").read_text())["model_fingerprint"] == fields["model_fingerprint"]


# ---------------------------------------------------------------------------- calibrate onto a full disk
class FullDisk(io.FileIO):
    """A file on a disk with ``ROOM`` bytes left: a write past them writes what fits, then fails
    with ENOSPC, as a full disk does."""

    ROOM = 4096

    def write(self, data) -> int:
        fits = max(0, self.ROOM - self.tell())
        if len(data) > fits:
            super().write(bytes(memoryview(data)[:fits]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def full_disk_open(path, mode="r", *args, **kwargs):
    """``open`` where a file opened to write lies on a full disk (``FullDisk``)."""
    if "w" in mode:
        return io.BufferedWriter(FullDisk(path, "w"))
    return open(path, mode, *args, **kwargs)


def test_calibrate_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, smollm):
    """It used to print a 78-line traceback (torch's RuntimeError "unexpected pos") and leave the
    temporary file behind."""
    import kvsieve.model_files

    monkeypatch.setattr(models, "load_model", lambda *a, **k: smollm)
    monkeypatch.setattr(kvsieve.model_files, "open", full_disk_open, raising=False)
    book = tmp_path / "book.txt"
    book.write_text("The fox walked to the river to drink. " * 40 + "\n")
    out = tmp_path / "stats.pt"
    assert error_of("calibrate", "triattention", "--data", book, "--out", out, "--tokens", "64", "--chunk", "32") == (
        f"{out}: the disk is full (No space left on device) while writing the statistics; free some space, then run "
        "the same command again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book.txt"]


@pytest.mark.parametrize("kind", ["statistics", "steering vector"])
def test_files_saved_with_torch_fail_on_a_full_disk_as_one_oserror_and_leave_nothing(tmp_path, monkeypatch, kind):
    import torch

    import kvsieve.model_files
    from kvsieve.methods.triattention import QueryStats
    from kvsieve.steering import SteeringVector

    q_mean = torch.randn(2, 4, 64, 2)
    saved = (QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1), inv_freq=torch.ones(64, dtype=torch.float64),
                        attention_scaling=1.0, num_kv_heads=2, model_name="m", fingerprint={})
             if kind == "statistics" else SteeringVector(torch.ones(4096), 1, "m", {}, {}))
    monkeypatch.setattr(kvsieve.model_files, "open", full_disk_open, raising=False)
    with pytest.raises(OutputError) as err:
        write_atomic(tmp_path / "x.pt", saved.save, f"writing the {kind}")
    assert str(err.value) == (f"{tmp_path / 'x.pt'}: the disk is full (No space left on device) while writing the "
                              f"{kind}; free some space, then run the same command again")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stop", [RuntimeError("unexpected pos 704 vs 598"), KeyboardInterrupt()])
def test_a_write_stopped_by_anything_else_leaves_no_temporary_file(tmp_path, stop):
    def write(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise stop

    with pytest.raises(type(stop)):
        write_atomic(tmp_path / "out.bin", write)
    assert list(tmp_path.iterdir()) == []
