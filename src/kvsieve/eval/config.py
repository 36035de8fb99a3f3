"""What one evaluation grid is: model, data, (method, budget) cells and decoding settings."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

# Config fields that change what a row contains: rows written under other values cannot be
# mixed into the same results directory (extending methods, budgets or --limit is fine).
RESULT_FIELDS = ("model", "dataset", "data_path", "data_options", "max_new_tokens", "temperature", "seed",
                 "settings", "prefill_chunk", "dtype")

Cell = tuple[str, "int | None"]  # (method, budget); budget None for full and self-sizing methods

# A method label is ``<method>`` or ``<method>+<variant>``: a variant is a cell of its own (its rows are
# keyed and summarised apart) that runs the same method under its own settings, e.g. ``lazy+protect``
# with ``--set lazy+protect.protect_prompt=true`` beside ``lazy`` at its paper default.  The variant
# ``steer`` is reserved: ``skipkv+steer`` runs its method with SkipKV's adaptive steering
# (``--steering FILE``).
VARIANT = "+"
STEER = "+steer"
_VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


def split_label(label: str) -> tuple[str, str]:
    """``"lazy+protect"`` -> ``("lazy", "protect")``; ``"tova"`` -> ``("tova", "")``."""
    method, _, variant = label.partition(VARIANT)
    if VARIANT in label and not _VARIANT_NAME.fullmatch(variant):
        raise ValueError(f"method label {label!r}: a variant after '+' is lower-case letters, digits and '-' "
                         "(e.g. lazy+protect)")
    return method, variant


def split_steer(label: str) -> tuple[str, bool]:
    """``"skipkv+steer"`` -> ``("skipkv", True)``; ``"tova"`` and ``"lazy+protect"`` -> (method, False)."""
    method, variant = split_label(label)
    return method, variant == STEER[1:]


def source_commit(package: "str | None" = None) -> str:
    """The git commit of the kvsieve source being run (``package``: the directory to ask, by
    default this package's); raises when it is not a clean git checkout (uncommitted changes
    under that directory would not be what the commit says)."""
    import subprocess
    from pathlib import Path

    package = Path(package) if package is not None else Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.CalledProcessError):
        raise ValueError(f"--pin-commit needs kvsieve run from a git checkout; {package} is not one") from None
    if dirty:
        raise ValueError(f"--pin-commit: {package} has uncommitted changes; commit them or run from a clean "
                         "worktree (git worktree add DIR COMMIT)")
    return commit


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard expects i/n such as 0/4, got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {text}: need 0 <= i < n")
    return index, count


def parse_list(text: str, what: str, cast=str) -> tuple:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise ValueError(f"{what} is empty; give a comma-separated list")
    try:
        return tuple(cast(item) for item in items)
    except ValueError:
        raise ValueError(f"{what}: cannot read {text!r} as a comma-separated list of {cast.__name__}") from None


def split_settings(pairs: dict[str, Any], methods: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``{"recent": 8, "tova.heads": "group"}`` -> per-label settings.  Unscoped keys go to every
    label but ``full``'s; ``method.key`` to that method and each of its variants (``method+steer``,
    ``method+protect``); ``method+variant.key`` to that label only, over the method's value."""
    out: dict[str, dict[str, Any]] = {m: {} for m in methods if split_label(m)[0] != "full"}
    scoped = []
    for key, value in pairs.items():
        if "." in key:
            scoped.append((key, value))
            continue
        for settings in out.values():
            settings[key] = value
    # a method's keys before its variants' keys, so the more specific one wins
    for key, value in sorted(scoped, key=lambda item: VARIANT in item[0].split(".", 1)[0]):
        label, name = key.split(".", 1)
        targets = [m for m in out if m == label or (VARIANT not in label and split_label(m)[0] == label)]
        if not targets:
            raise ValueError(f"setting {key!r} is for method {label!r}, which is not in --methods "
                             f"({', '.join(methods)})")
        for target in targets:
            out[target][name] = value
    return {m: s for m, s in out.items() if s}


@dataclass
class EvalConfig:
    """One evaluation grid.

    Parameters
    ----------
    model : str
        Bundled name, local directory or hub id (``kvsieve.models.load_model``).
    dataset : str
        A ``kvsieve.data`` name; ``data_path`` / ``data_options`` are passed to the loader.
    out : str
        Results directory (``results*.jsonl``, ``run.json``, later the report).
    methods, budgets : tuple
        The grid; ``full`` runs once per sample whether listed or not, as does every method
        that sizes its own cache (LagKV).
    limit : int | None
        N samples of the data set (before sharding), after the first ``skip``.
    skip : int
        Samples passed over at the start of the data set: ``skip=100, limit=50`` runs samples
        100-149 (a held-out slice; rows are keyed by sample id, so it is not a result field).
    reference_limit : int | None
        ``full`` runs on the first N samples only (None: all).  For a directory whose cells join an
        earlier one's report (``kvsieve report DIR --join NEW``), whose ``full`` is the reference:
        the joined ``full`` rows only show that both commits decode alike (``report.reproduced_full``).
    max_new_tokens, temperature, seed, prefill_chunk : decoding settings (``GenerateConfig``).
    batch_size : int
        Samples decoded together.
    settings : dict
        Per-method hyperparameters, ``{"tova": {"heads": "group"}}`` (see ``split_settings``).
    shard : (int, int)
        ``(i, n)``: this process runs samples ``i, i + n, i + 2n, ...``.
    device, dtype : str
        For ``load_model``.
    steering : str | None
        SkipKV steering vector file (``kvsieve steering build``) for the methods
        labelled ``<method>+steer`` (``full+steer``: steering alone); needed iff one is listed.
    steering_settings : dict
        ``alpha0`` / ``gamma`` / ``positions`` over the vector's preset (``Steering.preset``).
    pin_commit : bool
        Record the git commit of the kvsieve source in ``run.json`` (``source_commit``) and
        refuse to add rows from any other commit, or from a source tree with uncommitted changes:
        every row of a long grid then comes from one recorded version of the code.
    writer : str | None
        Tag of this process's results file, ``results.<writer>.jsonl``: several processes can
        then fill disjoint cells of one directory (e.g. one per budget) side by side; readers
        merge every results file.

    A steered label is a method of its own: its rows are keyed and summarised apart from the
    unsteered method's, carry ``settings["steering"]``, and the manifest records the steering
    (vector digest and strengths) among that label's settings, so a results directory refuses
    another vector or strength for it.  The file's path is not part of that identity.
    """

    model: str
    dataset: str
    out: str
    methods: tuple[str, ...] = ("full",)
    budgets: tuple[int, ...] = (128,)
    limit: int | None = None
    skip: int = 0
    reference_limit: int | None = None
    data_path: str | None = None
    data_options: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    prefill_chunk: int = 512
    batch_size: int = 8
    compile: bool = False  # the compiled decode step: same tokens, so not a RESULT_FIELD
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    shard: tuple[int, int] = (0, 1)
    device: str = "auto"
    dtype: str = "auto"
    steering: str | None = None
    steering_settings: dict[str, Any] = field(default_factory=dict)
    writer: str | None = None
    pin_commit: bool = False

    def __post_init__(self):
        from ..methods import takes_budget

        self.methods, self.budgets, self.shard = tuple(self.methods), tuple(self.budgets), tuple(self.shard)
        for method in self.methods:
            takes_budget(split_label(method)[0])  # raises on an unknown method or wrapper, naming the known ones
        steered = [m for m in self.methods if split_steer(m)[1]]
        if steered and self.steering is None:
            raise ValueError(f"method(s) {steered} need a steering vector: pass --steering FILE (build one with "
                             "kvsieve steering build --model MODEL --out FILE)")
        if self.steering is not None and not steered:
            raise ValueError(f"--steering is used only by methods labelled <method>{STEER}; add one to --methods, "
                             f"e.g. skipkv,skipkv{STEER} to compare without and with steering")
        if self.steering_settings and self.steering is None:
            raise ValueError("steering settings need --steering FILE")
        if self.steering is not None:
            self.steering_identity()  # an unreadable file or an unknown steering setting fails here
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ValueError(f"budgets must be positive token counts, got {list(self.budgets)}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError("batch_size and max_new_tokens must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.skip < 0:
            raise ValueError(f"skip must be >= 0, got {self.skip}")
        if self.reference_limit is not None and self.reference_limit < 1:
            raise ValueError(f"reference_limit must be >= 1, got {self.reference_limit}")
        if len(self.shard) != 2 or not 0 <= self.shard[0] < self.shard[1]:
            raise ValueError(f"shard must be (i, n) with 0 <= i < n, got {self.shard}")
        if self.writer is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", self.writer):
            raise ValueError(f"writer tag {self.writer!r}: use letters, digits, '-' and '_' only (it names results.<tag>.jsonl)")
        stray = set(self.settings) - set(self.methods)
        if stray:
            raise ValueError(f"settings given for method(s) {sorted(stray)} not in methods {list(self.methods)}")
        self.generate_config()  # a decoding setting it refuses fails here, before any model loads

    def generate_config(self):
        """The ``GenerateConfig`` every generated row of the grid decodes with: it stops at an invented
        next turn (``grading.NEXT_TURN_MARKERS``), where the grader cuts the answer anyway."""
        from ..generate import GenerateConfig
        from ..grading import NEXT_TURN_MARKERS

        return GenerateConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=self.seed,
                              prefill_chunk=self.prefill_chunk, compile=self.compile, stop_strings=NEXT_TURN_MARKERS)

    def cells(self) -> list[Cell]:
        """``full`` first (the reference), then every method at every budget it takes (once without
        a budget for a method that sizes its own cache, e.g. LagKV given its L and r)."""
        from ..methods import sizes_itself, takes_budget

        cells: list[Cell] = [("full", None)]
        for method in dict.fromkeys(self.methods):
            if method == "full":
                continue
            name = split_label(method)[0]
            if takes_budget(name) and not sizes_itself(name, self.settings.get(method, {})):
                cells += [(method, budget) for budget in dict.fromkeys(self.budgets)]
            else:
                cells.append((method, None))
        return cells

    def result_fields(self) -> dict[str, Any]:
        """The fields that must agree for rows to share a results directory (JSON-normalised);
        ``settings`` lists every method of this run, ``{}`` meaning its defaults."""
        fields = {k: asdict(self)[k] for k in RESULT_FIELDS}
        fields["settings"] = {m: self.settings.get(m, {}) for m in self.methods if m != "full"}
        if self.pin_commit:
            fields["source_commit"] = source_commit()
        if self.steering is not None:
            steering = self.steering_identity()
            for method in fields["settings"]:
                if split_steer(method)[1]:
                    fields["settings"][method] = {**fields["settings"][method], "steering": steering}
        return json.loads(json.dumps(fields, sort_keys=True))

    def same_settings(self, label: str, before: dict[str, Any], now: dict[str, Any]) -> bool:
        """Whether method ``label`` runs the same under ``before`` and ``now`` (its settings as
        ``result_fields`` records them): the same steering, and the same policy settings at every
        budget of this grid (``tova.sinks=0`` is TOVA's default, so it is no change)."""
        from ..methods import make_policy

        if before == now:
            return True
        if before.get("steering") != now.get("steering"):
            return False
        method = split_steer(label)[0]
        budgets = [budget for cell_label, budget in self.cells() if cell_label == label] or [None]
        own = [{k: v for k, v in settings.items() if k != "steering"} for settings in (before, now)]
        try:
            first, second = ([make_policy(method, budget=b, **s).settings() for b in budgets] for s in own)
        except ValueError:  # settings that no longer build a policy are a change
            return False
        return first == second

    def steering_identity(self) -> dict[str, Any]:
        """What the steered rows were produced under: ``Steering.settings()`` (layer, strengths,
        the vector's model, build settings and sha256), read from the file without the model."""
        from ..steering import Steering, SteeringVector

        return Steering.preset(SteeringVector.read(self.steering), **self.steering_settings).settings()

    @property
    def results_name(self) -> str:
        i, n = self.shard
        tag = "" if self.writer is None else f".{self.writer}"
        return f"results{tag}.jsonl" if n == 1 else f"results{tag}.shard{i}of{n}.jsonl"
