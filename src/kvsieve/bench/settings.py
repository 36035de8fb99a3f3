"""What each benchmark takes: one dataclass of settings per benchmark, whose fields are its options
(``new_tokens`` is ``--new-tokens``) with their defaults and help (``metadata["help"]``).

``kvsieve bench NAME`` (``kvsieve.cli``) makes one typer command from each class in
:data:`BENCHMARKS`; Python callers (``bench.gpu_check``, the tests) build the classes directly.
The module imports neither torch nor typer, so ``kvsieve --help`` stays fast and ``gpu_check``
runs where only torch and transformers are installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from ..checks import check_at_least


def option(default, help: str):
    """A settings field with the help its option shows."""
    return field(default=default, metadata={"help": help})


def names(csv: str) -> list[str]:
    """``"full,tova"`` -> ``["full", "tova"]`` (a comma-separated option)."""
    return [name for name in csv.split(",") if name]


def with_full(csv: str) -> list[str]:
    """The methods of ``csv`` with ``full``, the reference of every ratio, added first if missing."""
    methods = names(csv)
    return methods if "full" in methods else ["full", *methods]


def numbers(csv: str) -> list[int]:
    """``"1,8"`` -> ``[1, 8]`` (a comma-separated option of whole numbers)."""
    return [int(n) for n in names(csv)]


@dataclass
class Settings:
    """The options every benchmark takes to choose and place its model, and where it writes."""

    name: ClassVar[str]  # the benchmark: kvsieve bench NAME
    module: ClassVar[str] = ""  # kvsieve.bench.MODULE runs it, run(model, tokenizer, settings) (default: NAME)

    model: str = option("smollm2-135m", "bundled name, local dir, hub id or random:SHAPE")
    threads: Optional[int] = option(None, "torch CPU threads (default: torch's)")
    device: str = "auto"
    dtype: str = "auto"
    profile: Optional[str] = option(None, "write a torch profiler trace of the measured part (Chrome JSON, open in "
                                          "chrome://tracing or Perfetto) to this path, and its top operators to "
                                          "the path + .txt")
    out: Optional[str] = None

    def __post_init__(self):
        if self.threads is not None:
            check_at_least("threads", self.threads, 1)


@dataclass
class CompileSettings(Settings):
    """``--compile``: time the compiled decode step (``GenerateConfig.compile``), compile time apart."""

    compile: bool = option(False, "compiled decode step (torch.compile; compile time reported apart, never in tokens/s)")


@dataclass
class EngineSettings(CompileSettings):
    """Tokens/s and peak KV bytes of bounded caches vs the full cache."""

    name = "engine"

    methods: str = "full,tova,streaming"
    budget: int = 128
    new_tokens: int = 1024
    batches: str = "1,4"
    repeats: int = 1
    out: Optional[str] = "benchmarks/results/engine.json"


@dataclass
class OverheadSettings(CompileSettings):
    """Per-step cost of every policy vs full at the same live cache length."""

    name = "overhead"

    methods: Optional[str] = option(None, "comma-separated methods (default: every registered one but full, and "
                                          "the seed papers' wrapped ones: overhead.PAPER_WRAPPED)")
    lengths: str = "512,2048"
    batches: str = "1,8"
    steps: int = 16
    rounds: int = option(1, "paired runs per method; the median ratio is reported")
    budget: Optional[int] = option(None, "policies hold this many tokens while full holds the length "
                                         "(decode speed-up)")
    stats: Optional[str] = option(None, "TriAttention statistics of --model (kvsieve calibrate triattention); "
                                        "without it triattention is not timed")
    out: Optional[str] = "benchmarks/results/policy_overhead.json"


@dataclass
class ScaleSettings(CompileSettings):
    """Bounded caches at scale (``bench.scale``): one class of settings for memory, throughput and long."""

    module = "scale"

    methods: str = "tova,streaming"
    budget: int = 256
    new_tokens: int = 2048
    lengths: str = "4096,8192"
    batch: int = 1
    kv_memory_gb: float = 0.25
    max_batch: int = option(64, "cap on the admitted batch (CPU time)")
    out: Optional[str] = option(None, "default: benchmarks/results/NAME.json")


@dataclass
class MemorySettings(ScaleSettings):
    """Peak allocated KV bytes as generation grows (bounded methods stay flat)."""

    name = "memory"


@dataclass
class ThroughputSettings(ScaleSettings):
    """Largest batch under a KV memory limit and total tokens/s there, vs full."""

    name = "throughput"


@dataclass
class LongSettings(ScaleSettings):
    """Tokens/s of full vs bounded methods over long generations."""

    name = "long"

    methods: str = "tova,lazy"  # issue 7's long-generation comparison: full vs tova and lazy at budget 512
    budget: int = 512
    batch: int = 8


@dataclass
class GroupingSettings(CompileSettings):
    """What SkipKV's batch grouping by prefill length (Sec. 4.3, Eq. 12) changes in kvsieve."""

    name = "grouping"

    method: str = "skipkv"
    budget: int = 96
    dataset: str = "gsm8k"
    data: Optional[str] = option(None, "local file or directory of the data set")
    samples: int = 16
    batch: int = 4
    new_tokens: int = 128
    out: Optional[str] = "benchmarks/results/grouping.json"

    def __post_init__(self):
        super().__post_init__()
        check_at_least("batch", self.batch, 1)
        check_at_least("samples", self.samples, 1)


@dataclass
class CompiledSettings(Settings):
    """The compiled decode step vs eager, and vs transformers' generate (eager and static compiled)."""

    name = "compiled"

    methods: str = option("full,tova,lazy", "kvsieve methods, each timed eager and compiled (full always runs)")
    budget: int = 128
    new_tokens: int = 1024
    batches: str = "1,32"
    skip_transformers_static: bool = option(
        False, "leave out transformers' compiled static-cache generate (its compile is the slowest)")
    out: Optional[str] = "benchmarks/results/compiled.json"


BENCHMARKS: dict[str, type[Settings]] = {cls.name: cls for cls in (
    EngineSettings, OverheadSettings, MemorySettings, ThroughputSettings, LongSettings, GroupingSettings,
    CompiledSettings)}
