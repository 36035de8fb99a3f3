"""``kvsieve analyze mri``: a model's maximum recurrence intervals on a task, and the W they imply.

LazyEviction sets its observation window W to the MRI below which 80% of tokens fall (Sec. 3
Finding 3, Sec. 4 "choice of W", App. C), measured offline with a full cache on about 1% of
a data set (App. G.3, Table 11: 20 GSM8K, 5 MATH-500 or 2 AIME problems).  This module runs
that generation (greedy, nothing evicted, optionally batched), tracks TS and MRI with ``lazy``'s
own ``observe`` at its defaults (same alpha, GQA reduction and clock: decoding steps only, the
prompt born at the prefill, ``kvsieve.methods._timestamps``), so W is measured on the intervals
``lazy`` will see, and reads the MRI of every (layer, kv head, token) at the end of each sample.
(Before issue 35 the recorder counted every prompt query as a step, unlike ``lazy`` since issue 28.)

The distribution and W count the tokens re-activated at least once after their birth step
(MRI >= 1); tokens never re-activated (MRI 0) have no recurrence interval and are reported
apart.  ``recommended_window`` is the smallest W with MRI <= W for 80% of them; it is
the JSON key ``lazy`` reads for ``window="auto"``.  The histogram PNG is written beside it.
"""

import contextlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..generate import GenerateConfig, generate
from ..methods._timestamps import MODEL_FAMILY, model_alpha, resolve_alpha
from ..methods.lazy import LazyEviction
from ..hooks import HostHooks
from ..policy import Needs, Policy, Scorer
from .commands import PROMPT_FIELDS
from .commands import register_mri as register  # noqa: F401  (kvsieve analyze mri)

PERCENTILE = 80.0  # App. C: W = the 80% MRI threshold


@dataclass
class MRIRecorder(Scorer):
    """Tracks TS/MRI by ``lazy``'s own ``observe`` (its defaults, with this ``alpha`` and
    ``head_reduction``) and never evicts.  Keeps the layers it observed so their final state can
    be read after ``generate`` returns (the cache itself is not returned).

    ``alpha`` defaults to 1e-4, LazyEviction's Qwen value (App. C: DS-Qwen-7B, Qwen3-4B, QwQ-32B;
    App. G.2 / Table 10 on DS-Qwen-7B).  ``analyze()`` passes the alpha it is given or else the
    value of the model's own family (``model_alpha`` on its ``model_type``: 5e-4 for Llama,
    SmolLM2 included), as ``lazy``'s ``family="auto"`` does, so the default holds only for a
    recorder built directly."""

    # lazy's per-token state; no budget: nothing is ever compressed
    needs = Needs(meta=LazyEviction.needs.meta, observes=True, uses_budget=False)
    alpha: float = 1e-4
    head_reduction: str = "mean"
    layers: dict = field(default_factory=dict, init=False, repr=False)
    finished: list = field(default_factory=list, init=False, repr=False)  # MRIs of rows that left
    tracker: LazyEviction = field(init=False, repr=False)

    def __post_init__(self):
        self.tracker = LazyEviction(alpha=self.alpha, head_reduction=self.head_reduction)

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        yield HostHooks(on_rows_leave=self.rows_leave)

    def rows_leave(self, keep):
        """Rows that finished leave the cache: keep their final MRIs first."""
        leaving = torch.ones(self.rows(), dtype=torch.bool, device=keep.device)
        leaving[keep] = False
        self.finished += self.read(leaving)

    def rows(self) -> int:
        """Batch rows still in the cache (0 before the first observe)."""
        return next(iter(self.layers.values())).keys.shape[0] if self.layers else 0

    def read(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """MRI of every live (kv head, token) of ``rows`` [B] bool, one tensor per layer."""
        return [layer.meta["mri"][rows][layer.live()[rows]].cpu() for layer in self.layers.values()]

    def should_compress(self, layer, budget):
        return False

    def observe(self, layer, probs, query_pos, steps=False):
        self.layers[id(layer)] = layer
        self.tracker.observe(layer, probs, query_pos, steps)


def load_prompts(path, samples: int, seed: int = 0) -> list[str]:
    """``samples`` prompts drawn at random (seeded) from a JSONL file, in file order."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    from ..files import read_lines

    texts = []
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg}); fix or remove that line") from None
        text = next((row[k] for k in PROMPT_FIELDS if k in row), None) if isinstance(row, dict) else None
        if text is None:
            raise ValueError(f"{path}:{number}: every row needs one of the fields {list(PROMPT_FIELDS)}")
        texts.append(text)
    if not texts:
        raise ValueError(f"{path} holds no rows")
    picked = sorted(random.Random(seed).sample(range(len(texts)), min(samples, len(texts))))
    return [texts[i] for i in picked]


def collect_mri(model, tokenizer, prompts, max_new_tokens: int, alpha: float,
                head_reduction: str = "mean", batch_size: int = 1) -> tuple[np.ndarray, list[int]]:
    """Full-cache generation, ``batch_size`` prompts at a time. Returns every live token's final
    MRI (all layers, kv heads and samples) and the number of tokens generated per prompt.

    A row leaves the batch at its EOS (``check_every`` 1), so no token after EOS is ever
    observed, and its MRIs are read as it leaves: batching gives the same tokens as one prompt
    per call up to the float differences of batched matmuls."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = GenerateConfig(max_new_tokens=max_new_tokens, check_every=1)  # stop exactly at EOS
    mris, generated = [], []
    for start in range(0, len(prompts), batch_size):
        recorder = MRIRecorder(alpha=alpha, head_reduction=head_reduction)
        result = generate(model, tokenizer, prompts[start: start + batch_size], Policy(scorer=recorder), config)
        remaining = torch.ones(recorder.rows(), dtype=torch.bool, device=model.device)
        mris += recorder.finished + recorder.read(remaining)
        generated += [s.generated_tokens for s in result.stats]
    return torch.cat(mris).round().to(torch.int64).numpy(), generated


def summarize(mri: np.ndarray, percentile: float = PERCENTILE) -> dict:
    """Distribution of MRI over re-activated tokens and the recommended W."""
    recurring = mri[mri >= 1]
    if recurring.size == 0:
        raise ValueError("no token was re-activated: lower alpha or generate more tokens")
    edges = [1, 2, 5, 17, 65, 257, 1025]
    buckets = {f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo): float(((recurring >= lo) & (recurring < hi)).mean())
               for lo, hi in zip(edges, edges[1:])}
    buckets[f">={edges[-1]}"] = float((recurring >= edges[-1]).mean())
    return {
        "tokens": int(mri.size),
        "fraction_never_reactivated": float((mri == 0).mean()),
        "fraction_recurring": float((mri > 1).mean()),  # Finding 2: "MRI > 1"
        "quantiles": {f"p{q}": int(np.percentile(recurring, q, method="inverted_cdf")) for q in (50, 80, 90, 95, 99)},
        "buckets": buckets,
        "percentile": percentile,
        # the smallest W with at least `percentile`% of re-activated tokens at MRI <= W
        "recommended_window": int(np.percentile(recurring, percentile, method="inverted_cdf")),
        "counts_by_mri": np.bincount(recurring).tolist(),
    }


def save_histogram(mri: np.ndarray, window: int, path: Path, title: str) -> bool:
    """The MRI histogram with W marked (the paper's Fig. 3c). False if matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    recurring = mri[mri >= 1]
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    width = -(-int(recurring.max()) // 100)  # at most ~100 bars, each a whole number of steps
    bins = np.arange(1, recurring.max() + width + 1, width) - 0.5
    ax.hist(recurring, bins=bins, weights=np.full(recurring.size, 100 / recurring.size))
    ax.axvline(window, color="red", linestyle="--", label=f"{PERCENTILE:.0f}% of tokens: MRI <= {window} (W)")
    ax.set(xlabel="maximum recurrence interval (steps)", ylabel="% of re-activated tokens", title=title, yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def analyze(model, tokenizer, prompts, out, max_new_tokens: int = 1024, alpha: float | None = None,
            head_reduction: str = "mean", info: dict | None = None, batch_size: int = 1) -> dict:
    """Run, summarise, write ``out`` (JSON) and the PNG beside it; return the summary."""
    out = Path(out)
    if alpha is None:
        alpha = model_alpha(model, "analyze mri", "alpha", "(Table 10: 5e-4 for Llama, 1e-4 for Qwen)")
    alpha = resolve_alpha(alpha, MODEL_FAMILY, "analyze mri")  # refuses one outside (0, 1]
    mri, generated = collect_mri(model, tokenizer, prompts, max_new_tokens, alpha, head_reduction, batch_size)
    summary = {**(info or {}), "samples": len(prompts), "max_new_tokens": max_new_tokens, "alpha": alpha,
               "head_reduction": head_reduction, "mean_generated_tokens": float(np.mean(generated)),
               **summarize(mri)}
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    title = f"{summary.get('model', 'model')} on {Path(str(summary.get('dataset', 'prompts'))).stem}"
    summary["png"] = str(png) if save_histogram(mri, summary["recommended_window"], png, title) else None
    out.write_text(json.dumps(summary, indent=1))
    return summary
