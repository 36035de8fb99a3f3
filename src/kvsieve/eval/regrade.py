"""Re-grade stored rows with the current graders (``kvsieve regrade DIR``).

Rows keep the generated ``text`` and the ``reference``, so a grader fix never needs the model
again: every row with a text is graded anew, the rows whose ``extracted`` or ``correct`` change
are listed, and with ``write=True`` each results file is rewritten in one atomic replace after
a copy of the old file is kept beside it (``results.jsonl.bak-regrade-<time>``).

A row's grader kind is its ``grader`` field; rows written before that field existed take
``grader`` (the ``--grader`` option) or, failing that, the kind of the data set named in
``run.json``.  Rows scored by perplexity have no text and are left as they are.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..grading import GRADERS, grade
from .store import RESULTS_GLOB, read_manifest, read_rows, rewrite_rows, row_key, writer_lock


@dataclass
class Change:
    """One row whose grade changed."""

    key: tuple
    before: tuple[Any, bool]  # (extracted, correct)
    after: tuple[Any, bool]


@dataclass
class Regrade:
    """What a regrade found (and, when written, where the old files were kept)."""

    rows: int = 0
    graded: int = 0
    changes: list[Change] = field(default_factory=list)
    backups: list[Path] = field(default_factory=list)


def _manifest_grader(directory: Path) -> str | None:
    """The grader kind of the data set in ``run.json`` (one sample loaded), or None."""
    from ..data import DataError, load_dataset

    manifest = read_manifest(directory)
    if not manifest:
        return None
    try:
        samples = load_dataset(manifest["dataset"], path=manifest.get("data_path"), limit=1,
                               **(manifest.get("data_options") or {}))
    except (DataError, KeyError, ValueError, OSError):
        return None
    return samples[0].grader if samples else None


def regrade(directory: str | os.PathLike, write: bool = False, grader: str | None = None) -> Regrade:
    """Grade every stored row with a text again; rewrite the results files when ``write``.

    Without ``write`` it only reads, so it may run beside an eval that is appending rows.
    Raises ValueError for an unknown ``grader``, a directory without results, rows whose grader
    kind cannot be told, or (with ``write``) a results file an eval is still appending to.
    """
    directory = Path(directory)
    if grader is not None and grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}; graders: {', '.join(GRADERS)}")
    paths = sorted(directory.glob(RESULTS_GLOB))
    if not paths:
        raise ValueError(f"{directory} holds no results files ({RESULTS_GLOB}); give a directory written by kvsieve eval")
    fallback = grader or _manifest_grader(directory)
    found = Regrade()
    for path in paths:
        with writer_lock(path) if write else nullcontext():  # no eval may append while a file is replaced
            rows = list(read_rows(path))
            changed = _regrade_rows(path, rows, fallback, found)
            if write and changed:
                found.backups.append(_replace(path, rows))
    return found


def _regrade_rows(path: Path, rows: list[dict], fallback: str | None, found: Regrade) -> bool:
    """Grade ``rows`` in place, recording changes in ``found``; returns whether any changed."""
    changed = False
    for row in rows:
        found.rows += 1
        if "text" not in row or "reference" not in row:
            continue  # perplexity rows
        kind = row.get("grader") or fallback
        if kind is None:
            raise ValueError(f"{path}: row {row_key(row)} has no 'grader' and run.json's data set cannot be "
                             f"loaded to tell it; pass --grader ({', '.join(GRADERS)})")
        graded = grade(kind, row["text"], row["reference"], truncated=row.get("finish_reason") == "length")
        found.graded += 1
        before, after = (row.get("extracted"), row.get("correct")), (graded.extracted, graded.correct)
        if before != after:
            found.changes.append(Change(row_key(row), before, after))
            changed = True
        row.update(grader=kind, extracted=graded.extracted, correct=graded.correct)
    return changed


def _replace(path: Path, rows: list[dict]) -> Path:
    """Keep a copy of ``path``, then swap in the re-graded rows atomically; returns the copy."""
    backup = path.with_name(f"{path.name}.bak-regrade-{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.copy2(path, backup)
    rewrite_rows(path, rows)
    return backup
