"""Resumable results: one JSON line per finished sample, made durable before the next one.

Layout of a results directory::

    run.json                          the settings every row was produced under (RESULT_FIELDS)
    results.jsonl                     rows of an unsharded run
    results.shard{i}of{n}.jsonl       rows of shard i of n (each process appends to its own file)
    results.<writer>[.shard..].jsonl  rows of a process started with ``--writer`` (disjoint cells)

A row is keyed by ``(id, method, budget)``.  Appends are an unbuffered ``write + fsync`` of one
whole line, so a killed run loses at most the line being written; that torn tail is cut off when
the file is opened again.  A write that fails (a full disk) is cut back at once and told in one
line (``kvsieve.files.OutputError``).  Readers merge every results file and keep the first row of
each key; a line that is no row (``row_problem``: a hand edit) is named by file and line.
A writer holds an exclusive lock on ``.<file>.lock`` beside its file, so a second eval (or
``kvsieve regrade``) on the same file fails at once instead of interleaving rows.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..checks import InputError
from ..files import check_output_dir, output_error, read_lines, read_text, write_atomic

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer per file is then up to the user
    fcntl = None

Key = tuple[str, str, "int | None"]
MANIFEST = "run.json"
FINGERPRINT = "model_fingerprint"  # run.json's and each row's record of the model's files
RESULTS_GLOB = "results*.jsonl"


def row_key(row: dict[str, Any]) -> Key:
    return (str(row["id"]), row["method"], row["budget"])


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (no trailing newline) left by a killed writer."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        warnings.warn(f"{path}: dropped a torn last line ({len(data) - keep} bytes) from an interrupted run")


# Fields of a row that hold numbers when present (report and plots compute with them).
NUMBER_FIELDS = ("prompt_tokens", "generated_tokens", "peak_kv_tokens", "steady_peak_kv_tokens", "final_kv_tokens",
                 "final_kv_tokens_mean", "peak_kv_bytes", "tokens_per_s", "prefill_s", "decode_s",
                 "compression_events", "kv_heads", "batch_size", "time", "scored_tokens", "nll", "perplexity")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def row_problem(row: Any) -> str | None:
    """What makes ``row`` no results row (a hand edit, a line of another file), or None when it is one:
    a JSON object with ``id`` (text or integer), ``method`` (text), ``budget`` (an integer or null),
    ``correct`` true/false/null and numbers in ``NUMBER_FIELDS``, where present."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    missing = [k for k in ("id", "method", "budget") if k not in row]
    if missing:
        return f"no {', '.join(repr(k) for k in missing)}"
    if not isinstance(row["id"], (str, int)) or isinstance(row["id"], bool):
        return f"'id' is {row['id']!r}, not text or an integer"
    if not isinstance(row["method"], str):
        return f"'method' is {row['method']!r}, not text"
    if row["budget"] is not None and not (isinstance(row["budget"], int) and not isinstance(row["budget"], bool)):
        return f"'budget' is {row['budget']!r}, not an integer or null"
    if row.get("correct") not in (True, False, None):
        return f"'correct' is {row['correct']!r}, not true, false or null"
    wrong = [k for k in NUMBER_FIELDS if row.get(k) is not None and not _is_number(row[k])]
    if wrong:
        return f"{wrong[0]!r} is {row[wrong[0]]!r}, not a number"
    return None


def read_rows(path: Path, bad: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Rows of one results file; a torn last line is skipped.  A line that is no results row
    (``row_problem``) is an ``InputError`` naming the file and line, or, given a list ``bad``, is
    skipped and its message appended to ``bad`` (a report goes on with the other rows)."""
    lines = read_lines(path)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                continue  # no newline after it: being written right now, or torn by a kill
            problem = f"not a JSON row ({err.msg})"
        else:
            problem = row_problem(row)
            if problem is not None:
                problem = f"not a results row ({problem})"
        if problem is None:
            yield row
            continue
        message = f"{path}:{number}: {problem}; remove or fix that line"
        if bad is None:
            raise InputError(message)
        bad.append(message)


def load_results(directory: str | os.PathLike, bad: list[str] | None = None) -> list[dict[str, Any]]:
    """Every row in a results directory, merged over shard files, first row of each key kept;
    ``bad``: as ``read_rows``'s (None: a bad line is an error)."""
    rows, seen, duplicates = [], set(), 0
    for path in sorted(Path(directory).glob(RESULTS_GLOB)):
        for row in read_rows(path, bad):
            key = row_key(row)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            rows.append(row)
    if duplicates:
        warnings.warn(f"{directory}: {duplicates} duplicate row(s) across results files ignored")
    return rows


def _row_line(row: dict[str, Any]) -> str:
    """One row as a line of a results file."""
    return json.dumps(row, ensure_ascii=False) + "\n"


def rewrite_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace results file ``path`` with ``rows`` in one atomic step (hold its ``writer_lock``)."""
    write_atomic(path, "".join(_row_line(row) for row in rows), "rewriting the rows")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """``run.json`` of a results directory, or {} when it has none; an ``InputError`` naming it when it
    is not a JSON object (cut short by a full disk, or edited by hand)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = json.loads(read_text(path))
        problem = None if isinstance(manifest, dict) else f"a JSON {type(manifest).__name__}"
    except json.JSONDecodeError as err:
        problem = f"{err.msg} at line {err.lineno}"
    if problem is not None:
        raise InputError(f"{path}: not the settings record kvsieve eval writes ({problem}: cut short or edited); "
                         "restore it, or delete it and run the same eval command to write it again")
    return manifest


def _take_lock(path: Path):
    """An open lock file held exclusively for ``path``; InputError if another process holds it."""
    lock = path.with_name(f".{path.name}.lock")
    try:
        handle = open(lock, "a")
    except OSError as err:
        raise output_error(err, lock, "taking the writer lock") from None
    if fcntl is not None:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise InputError(f"{path} is being written by another process (a kvsieve eval still running?); "
                             "wait for it to finish or stop it, or use another --out / --shard") from None
    return handle


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold the writer lock of results file ``path`` for the enclosed block."""
    handle = _take_lock(path)
    try:
        yield
    finally:
        handle.close()  # closing releases the lock


class ResultStore:
    """Appends rows to this process's results file and knows which keys are done in the directory."""

    def __init__(self, directory: str | os.PathLike, filename: str = "results.jsonl"):
        self.directory = check_output_dir(directory)
        self.path = self.directory / filename
        self._lock = _take_lock(self.path)
        try:
            _repair_tail(self.path)
            rows = load_results(self.directory)
            # unbuffered: a write that fails (a full disk) leaves nothing behind to be flushed later
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            self._lock.close()
            raise output_error(err, self.path, "opening the results file") from None
        except BaseException:
            self._lock.close()
            raise
        self.done: set[Key] = {row_key(row) for row in rows}
        # (method, budget) -> settings of the cell's first row (runner.check_cell_settings)
        self.cell_settings: dict[tuple, dict] = {}
        for row in rows:
            self.cell_settings.setdefault((row["method"], row["budget"]), row.get("settings") or {})
        # sample id -> the prompt hash its rows ran on (runner.check_prompts)
        self.prompts: dict[str, str] = {row["id"]: row["prompt_sha256"] for row in rows if "prompt_sha256" in row}

    def append(self, row: dict[str, Any]) -> bool:
        """Write ``row`` durably unless its key is already done; returns whether it was written.
        A write that fails (a full disk) is cut back to the rows before it and raises an
        ``OutputError`` saying that those are kept and the same command resumes."""
        key = row_key(row)
        if key in self.done:
            return False
        data = _row_line(row).encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)  # no torn line left behind
            kept = f"{len(self.done)} row{'s' if len(self.done) != 1 else ''}"
            raise output_error(err, self.path, "writing a row",
                               f"run the same command again: it resumes after the {kept} kept") from None
        self.done.add(key)
        return True

    def close(self) -> None:
        os.close(self._fd)
        self._lock.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fingerprint_differences(before: dict, now: dict) -> list[str]:
    """The fields in which two model fingerprints (``kvsieve.models.checkpoint_fingerprint``)
    differ, compared on the fields both hold: a record made before a field existed (the hash of
    every weight byte, ``weights_sha256_whole``) is judged by the others; when they share no field
    (a ``random:`` model against a checkpoint), every field."""
    fields = set(before) & set(now) or set(before) | set(now)
    return sorted(k for k in fields if before.get(k) != now.get(k))


def model_changed(directory: str | os.PathLike, model: str | None, before: dict, now: dict, where: str) -> str:
    """The refusal of a resume whose model's fingerprint (``now``) is not the one ``where`` (run.json,
    or its rows) records (``before``), naming the fields that differ with both values."""
    differ = [f"{k} {before.get(k)} there, {now.get(k)} now" for k in fingerprint_differences(before, now)]
    return (f"{directory}: --model {model} is not the model its rows were made with (replaced in place?): {where} "
            f"records {'; '.join(differ)}; use another --out directory, or the model the rows were made with")


def check_manifest(directory: str | os.PathLike, fields: dict[str, Any],
                   same: Callable[[str, dict, dict], bool] | None = None) -> None:
    """Write ``run.json`` on the first run; on later runs refuse settings that would mix results.

    ``fields[FINGERPRINT]`` (``kvsieve.models.checkpoint_fingerprint``) is the model's: another one
    under the same ``--model`` (a checkpoint replaced in place) than run.json's, or, without a
    run.json, than the rows', is refused naming both (``fingerprint_differences``); a manifest
    written before fingerprints, or before one of their fields, was recorded takes it now, and None
    (not known) checks nothing.

    ``fields["settings"]`` maps method -> its settings: a method already in the manifest must
    keep its settings, a new method joins it (extending a grid with methods is fine).
    ``same(method, before, now)`` says whether two settings the user typed differently run the
    method the same (``tova.sinks=0`` where 0 is the default): those keep the manifest's record.
    """
    path = Path(directory) / MANIFEST
    merged = dict(fields)
    if path.exists():
        old = read_manifest(directory)
        before, now = old.get(FINGERPRINT), fields.get(FINGERPRINT)
        if before is not None and now is not None and fingerprint_differences(before, now):
            raise InputError(model_changed(directory, fields.get("model"), before, now, "run.json"))
        # a directory from before fingerprints, or before a field of them: recorded now
        merged[FINGERPRINT] = {**before, **now} if before is not None and now is not None else before or now
        differ = [f"{k}: {old.get(k)!r} before, {fields.get(k)!r} now" for k in sorted(set(old) | set(fields))
                  if k not in ("settings", FINGERPRINT) and old.get(k) != fields.get(k)]
        old_settings, new_settings = old.get("settings") or {}, fields.get("settings") or {}
        changed = [m for m in sorted(set(old_settings) & set(new_settings)) if old_settings[m] != new_settings[m]
                   and not (same is not None and same(m, old_settings[m], new_settings[m]))]
        differ += [f"settings of {m}: {old_settings[m]!r} before, {new_settings[m]!r} now" for m in changed]
        if differ:
            raise InputError(f"{directory} holds results produced under other settings ({'; '.join(differ)}); "
                             "use another --out directory or the same settings")
        merged["settings"] = {**new_settings, **old_settings}  # an equivalent setting keeps its first record
        if merged == old:
            return
    else:  # run.json deleted (or never written): the rows say which model made them
        now = fields.get(FINGERPRINT)
        other = [r[FINGERPRINT] for r in load_results(directory)
                 if r.get(FINGERPRINT) is not None and now is not None and fingerprint_differences(r[FINGERPRINT], now)]
        if other and now is not None:
            raise InputError(model_changed(directory, fields.get("model"), other[0], now, "its rows"))
    check_output_dir(directory)
    # atomic: shards starting together never see half a manifest
    write_atomic(path, json.dumps(merged, indent=2, sort_keys=True) + "\n", "writing the run's settings")
