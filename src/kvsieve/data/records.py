"""Raw rows from local files and the hub, each remembering where it came from.

Every loader reads rows as :class:`Record` so that a malformed row is reported as
``file:line: field 'answer': ...`` whatever the source format.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .. import files


class DataError(ValueError):
    """A data set could not be found or one of its rows is malformed."""


@dataclass(frozen=True)
class Record:
    """One raw row: its fields and its location (file and 1-based line, or hub name and row)."""

    fields: dict[str, Any]
    source: str
    line: int

    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def error(self, field: str, problem: str) -> DataError:
        return DataError(f"{self.where()}: field {field!r}: {problem}")

    def get(self, *names: str, required: bool = True) -> Any:
        """The first of ``names`` present with a non-empty value; a clear error when none is."""
        for name in names:
            value = self.fields.get(name)
            if value is not None and str(value).strip() != "":
                return value
        if not required:
            return None
        alternatives = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
        present = ", ".join(sorted(map(str, self.fields))) or "none"
        missing_or_empty = "empty" if any(n in self.fields for n in names) else "missing"
        raise DataError(
            f"{self.where()}: field {names[0]!r}{alternatives} is {missing_or_empty}; fields present: {present}")

    def text(self, *names: str) -> str:
        value = self.get(*names)
        if not isinstance(value, (str, int, float)):
            raise self.error(names[0], f"expected text, got {type(value).__name__}")
        return str(value).strip()


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of a data file; a DataError naming the file and line of the first byte that is not UTF-8."""
    return files.read_text(path, DataError)


def read_jsonl(path: Path) -> Iterator[Record]:
    for line_no, line in enumerate(files.read_lines(path, DataError), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{line_no}: invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        yield Record(row, str(path), line_no)


def read_json(path: Path) -> Iterator[Record]:
    """A JSON file holding a list of objects; ``line`` is then the row's index + 1."""
    try:
        rows = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of objects (or use .jsonl)")
    for index, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{index}: expected a JSON object, got {type(row).__name__}")
        yield Record(row, str(path), index)


def read_csv(path: Path) -> Iterator[Record]:
    """CSV with a header line; ``line`` is the line where the row starts."""
    with io.StringIO(read_text(path), newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:  # reads the header, so line_num counts from it
            raise DataError(f"{path}: empty CSV file (expected a header line)")
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                raise DataError(f"{path}:{start}: malformed CSV ({err})") from None
            if None in row:  # more cells than header columns
                raise DataError(f"{path}:{start}: {len(row) - 1 + len(row[None])} cells but the header has "
                                f"{len(row) - 1} columns")
            yield Record(row, str(path), start)


READERS = {".jsonl": read_jsonl, ".json": read_json, ".csv": read_csv}


def read_records(path: str | os.PathLike) -> Iterator[Record]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} is not a regular file (a device or a pipe); give a file" if path.exists()
                        else f"data file {path} does not exist")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(READERS)}")
    return reader(path)


def read_hub(name: str, config: str | None, split: str) -> Iterator[Record]:
    """Rows of a Hugging Face hub data set (needs the ``datasets`` package and network access)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DataError(f"hub data set {name} is unavailable offline (HF_HUB_OFFLINE=1)")
    try:
        import datasets
    except ImportError:
        raise DataError(f"loading {name} from the hub needs the datasets package: "
                        "pip install 'kvsieve[hub]' (or datasets)") from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # network, auth (gated sets), missing split: all mean "not from the hub"
        raise DataError(f"could not load hub data set {name} ({type(err).__name__}: {err})") from None
    label = f"hub:{name}" + (f"/{config}" if config else "") + f"[{split}]"
    for index, row in enumerate(rows, start=1):
        yield Record(dict(row), label, index)
