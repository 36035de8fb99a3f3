"""Resumable results: one JSON line per finished sample, made durable before the next one.

Layout of a results directory::

    run.json                          the settings every row was produced under (RESULT_FIELDS)
    results.jsonl                     rows of an unsharded run
    results.shard{i}of{n}.jsonl       rows of shard i of n (each process appends to its own file)
    results.<writer>[.shard..].jsonl  rows of a process started with ``--writer`` (disjoint cells)

A row is keyed by ``(id, method, budget)``.  Appends are ``write + flush + fsync`` of one whole
line, so a killed run loses at most the line being written; that torn tail is cut off when the
file is opened again.  Readers merge every results file and keep the first row of each key.
A writer holds an exclusive lock on ``.<file>.lock`` beside its file, so a second eval (or
``kvsieve regrade``) on the same file fails at once instead of interleaving rows.
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from ..checks import InputError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one writer per file is then up to the user
    fcntl = None

Key = tuple[str, str, "int | None"]
MANIFEST = "run.json"
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


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of one results file; a torn last line is skipped, a bad line elsewhere is an error."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not line.endswith("\n"):
                continue  # being written right now, or torn by a kill
            raise InputError(f"{path}:{number}: not a JSON row ({err.msg}); remove or fix that line") from None


def load_results(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row in a results directory, merged over shard files, first row of each key kept."""
    rows, seen, duplicates = [], set(), 0
    for path in sorted(Path(directory).glob(RESULTS_GLOB)):
        for row in read_rows(path):
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
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(_row_line(row) for row in rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """``run.json`` of a results directory, or {} when it has none."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _take_lock(path: Path):
    """An open lock file held exclusively for ``path``; InputError if another process holds it."""
    handle = open(path.with_name(f".{path.name}.lock"), "a")
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
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / filename
        self._lock = _take_lock(self.path)
        try:
            _repair_tail(self.path)
            rows = load_results(self.directory)
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
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, row: dict[str, Any]) -> bool:
        """Write ``row`` durably unless its key is already done; returns whether it was written."""
        key = row_key(row)
        if key in self.done:
            return False
        self._file.write(_row_line(row))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(key)
        return True

    def close(self) -> None:
        self._file.close()
        self._lock.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_manifest(directory: str | os.PathLike, fields: dict[str, Any],
                   same: Callable[[str, dict, dict], bool] | None = None) -> None:
    """Write ``run.json`` on the first run; on later runs refuse settings that would mix results.

    ``fields["settings"]`` maps method -> its settings: a method already in the manifest must
    keep its settings, a new method joins it (extending a grid with methods is fine).
    ``same(method, before, now)`` says whether two settings the user typed differently run the
    method the same (``tova.sinks=0`` where 0 is the default): those keep the manifest's record.
    """
    path = Path(directory) / MANIFEST
    merged = dict(fields)
    if path.exists():
        old = read_manifest(directory)
        differ = [f"{k}: {old.get(k)!r} before, {fields.get(k)!r} now" for k in sorted(set(old) | set(fields))
                  if k != "settings" and old.get(k) != fields.get(k)]
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
    Path(directory).mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: shards starting together never see half a manifest
