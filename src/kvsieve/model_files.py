"""Files made for one model (a SkipKV steering vector, TriAttention statistics): the model's
fingerprint they record, saving and loading them, and the refusal when they are used with another model.

Light on purpose (torch only), so a method file can read its per-model file without importing
anything above ``methods/``.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch


def model_name(model) -> str:
    return Path(str(getattr(model.config, "_name_or_path", "") or "unknown")).name


def model_fingerprint(model) -> dict:
    c = model.config
    return {k: getattr(c, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}


def other_model(name: str, fingerprint: dict, model) -> str | None:
    """"built for NAME {fingerprint}, not for MODEL {its fingerprint}" when a file made for the model
    ``name`` with ``fingerprint`` does not belong to ``model``; None when it does."""
    if fingerprint == model_fingerprint(model) and name == model_name(model):
        return None
    return f"built for {name} {fingerprint}, not for {model_name(model)} {model_fingerprint(model)}"


def save_file(data: dict, path: str | Path) -> None:
    """``torch.save`` ``data`` to ``path`` so that a write that fails (a full disk) is the ``OSError``
    naming its cause, which ``files.write_atomic`` tells in one line: torch writing to a path, or to a
    file that fails, ends with its own ``RuntimeError`` ("unexpected pos"), which says neither file
    nor cause.  The file is made in memory first (these files are small) and written by Python."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def load_saved(path: str | Path, what: str, hint: str):
    """What ``torch.save`` wrote at ``path`` (tensors and plain data only), or a ValueError naming
    ``what`` the file should hold and ``hint``, how to make one."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{what} file {path} does not exist; {hint}") from None
    except Exception as err:  # torch raises several kinds on a file it cannot read
        raise ValueError(f"{path} is not a {what} file ({type(err).__name__}); {hint}") from None
