"""kvsieve: bounded KV caches for long generation with Hugging Face models.

The names below are imported on first use, so that ``import kvsieve`` (and with it ``kvsieve
--version`` and ``--help``) loads neither torch nor transformers.  The ``kvsieve`` attention
implementation is registered with transformers by ``kvsieve.attention``, which every entry point
that switches a model to it imports (``generate``, ``SieveCache.for_model``, the benchmarks).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

_EXPORTS = {  # name -> the submodule to take it from
    "SieveCache": "hf", "SieveLayer": "cache",  # SieveCache by way of hf, which serves SieveCache.for_model
    "GenerateConfig": "generate", "GenerationResult": "generate", "RowStats": "generate", "generate": "generate",
    "make_policy": "methods", "method_names": "methods",
    "Policy": "policy", "Scorer": "policy", "register": "policy",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


class _Package(types.ModuleType):
    """``kvsieve.generate`` is the function, as when this package imported it eagerly: importing
    the submodule of the same name (which binds the module on its package) binds the function."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from .cache import SieveCache, SieveLayer
    from .generate import GenerateConfig, GenerationResult, RowStats, generate
    from .methods import make_policy, method_names
    from .policy import Policy, Scorer, register
