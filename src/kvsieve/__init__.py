"""kvsieve: bounded KV caches for long generation with Hugging Face models."""

from . import attention  # noqa: F401  (registers the "kvsieve" attention implementation)
from . import hf  # noqa: F401  (serves SieveCache.for_model)
from .cache import SieveCache, SieveLayer
from .generate import GenerateConfig, GenerationResult, RowStats, generate
from .methods import make_policy, method_names
from .policy import Policy, Scorer, register

__all__ = [
    "GenerateConfig", "GenerationResult", "Policy", "RowStats", "Scorer", "SieveCache", "SieveLayer",
    "generate", "make_policy", "method_names", "register",
]
__version__ = "0.1.0"
