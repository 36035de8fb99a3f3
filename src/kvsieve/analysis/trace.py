"""Eviction traces: which positions each kv head kept at every compression, and a heatmap of them.

Opt-in and outside the engine: ``TraceRecorder.wrap(policy)`` returns a policy whose scorer
hands every hook to the real scorer and, when a layer is compressed, reads the positions
the layer holds afterwards (``layer.meta["pos"]``).  A compaction happens right after the
scorer's ``select``; the recorder reads the result at its next call from the engine (or in
``finish``), keeping only positions below the row's ``seen_tokens`` at the compression, so
tokens appended since are excluded and the record is exact.

Layers are numbered in the order the engine first asks about them, which is layer order
(every pass over the cache starts at layer 0).  Rows are *prompt* indices, the position of the
prompt in the ``generate`` call, not cache rows: ``generate`` drops finished rows from the cache
(``cache.select_rows``), after which cache row i holds a later prompt.  The recorder follows the
mapping through the ``rows`` argument of the per-forward callback that ``attach`` yields, so a
record is attributed to the prompt it was taken from however many rows left before it was read.

Reads are lazy (at the next call from the engine).  ``generate`` calls
``TracingScorer.attach``'s ``on_rows_leave`` just before ``cache.select_rows``, which reads everything
due, so a prompt leaving the batch right after a compression keeps its last records; a record
that still cannot be read is counted in ``Trace.lost``, never attributed to another prompt.

Record layout (``Trace``)::

    records[i] = (layer, row = prompt index, seen_tokens, head, kept positions: sorted int32 array)
"""

from __future__ import annotations

import contextlib
import json
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checks import InputError
from ..hooks import HostHooks
from ..policy import Policy, Scorer

TRACE_HINT = "give a trace.npz written by kvsieve analyze trace"


@dataclass
class Trace:
    """Kept positions per (compression event, layer, row, kv head) plus free-form metadata."""

    layer: list[int] = field(default_factory=list)
    row: list[int] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)
    head: list[int] = field(default_factory=list)
    kept: list[np.ndarray] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    lost: int = 0

    def __len__(self) -> int:
        return len(self.kept)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        offsets = np.cumsum([0, *[len(k) for k in self.kept]])
        np.savez_compressed(path, layer=np.array(self.layer, dtype=np.int32), row=np.array(self.row, dtype=np.int32),
                            seen=np.array(self.seen, dtype=np.int64), head=np.array(self.head, dtype=np.int32),
                            offsets=offsets, positions=np.concatenate(self.kept or [np.zeros(0, np.int32)]),
                            meta=np.array(json.dumps({**self.meta, "lost": self.lost})))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """The trace ``save`` wrote at ``path``; an ``InputError`` naming the file when it is none."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"trace file {path} does not exist; {TRACE_HINT}")
        try:
            with np.load(path) as z:
                offsets, positions = z["offsets"], z["positions"]
                meta = json.loads(str(z["meta"]))
                kept = [positions[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
                return cls(z["layer"].tolist(), z["row"].tolist(), z["seen"].tolist(), z["head"].tolist(), kept,
                           meta, meta.pop("lost", 0))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile) as err:
            # not an .npz (pickled or plain text), an .npy (no `with`), another .npz (no such key), bad meta
            raise InputError(f"{path} is not a trace file ({type(err).__name__}); {TRACE_HINT}") from None

    def steps(self, row: int = 0) -> list[int]:
        """The row's compression events, as its ``seen_tokens`` at each."""
        return sorted({s for s, r in zip(self.seen, self.row) if r == row})

    def kept_fraction(self, row: int = 0, layer: int | None = None, head: int | None = None) -> tuple[list[int], np.ndarray]:
        """``(steps, matrix [events, positions])``: share of the chosen (layer, head) records that
        kept each position at each event (NaN where the position did not exist yet)."""
        steps = self.steps(row)
        width = max(steps, default=0)
        kept = np.zeros((len(steps), width))
        count = np.zeros(len(steps))
        index = {s: i for i, s in enumerate(steps)}
        for i in range(len(self)):
            if self.row[i] != row or (layer is not None and self.layer[i] != layer) or (head is not None and self.head[i] != head):
                continue
            event = index[self.seen[i]]
            kept[event, self.kept[i]] += 1
            count[event] += 1
        with np.errstate(invalid="ignore", divide="ignore"):
            matrix = kept / count[:, None]
        for event, seen in enumerate(steps):
            matrix[event, seen:] = np.nan
        return steps, matrix


class _Recording:
    """The shared state of one traced generation: layer numbering, the prompt index of each cache
    row, and reads still due."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.layers: list[Any] = []  # layer objects, index = layer number (kept alive: ids stay unique)
        self.prompts: list[int] | None = None  # prompt index of each cache row; None: not attached (row i = prompt i)
        self.attached = False
        # (layer number, layer, seen_tokens [B] at compression, prompt index of each of those B rows)
        self.pending: list[tuple[int, Any, torch.Tensor, list[int]]] = []

    def number(self, layer) -> int:
        for i, known in enumerate(self.layers):
            if known is layer:
                return i
        self.layers.append(layer)
        return len(self.layers) - 1

    def rows_now(self, batch: int) -> list[int]:
        return list(range(batch)) if self.prompts is None else self.prompts

    def follow(self, rows: torch.Tensor) -> None:
        """``rows`` [B]: prompt index of each cache row, as ``generate`` passes it before each forward.
        Rows only ever leave, so the mapping changed iff B did: no device read on other steps."""
        if self.prompts is None or rows.shape[0] != len(self.prompts):
            self.prompts = [int(r) for r in rows.tolist()]
        self.flush()

    def compressed(self, layer, seen_tokens: torch.Tensor) -> None:
        seen = seen_tokens.detach().to("cpu")
        self.pending.append((self.number(layer), layer, seen, self.rows_now(seen.shape[0])))

    def flush(self) -> None:
        """Read the kept positions of every layer compressed since the last call."""
        for number, layer, seen, prompts in self.pending:
            pos = layer.meta["pos"].detach().to("cpu", torch.int64)  # [B now, H, capacity]
            if pos.shape[0] == len(prompts):  # rows only leave: the same count is the same rows
                now = prompts
            elif self.prompts is not None and len(self.prompts) == pos.shape[0]:
                now = self.prompts
            else:  # rows left and the mapping was not followed (not attached): no row is known
                self.trace.lost += pos.shape[1] * len(prompts)
                continue
            at = {prompt: i for i, prompt in enumerate(prompts)}
            self.trace.lost += pos.shape[1] * len(set(prompts) - set(now))  # left before this read
            for row, prompt in enumerate(now):
                limit = int(seen[at[prompt]])
                for head in range(pos.shape[1]):
                    p = pos[row, head]
                    self.trace.layer.append(number)
                    self.trace.row.append(prompt)
                    self.trace.seen.append(limit)
                    self.trace.head.append(head)
                    self.trace.kept.append(np.sort(p[p < limit].numpy()).astype(np.int32))
        self.pending.clear()


@dataclass
class TracingScorer(Scorer):
    """The scorer ``inner`` with every hook of the ``Scorer`` contract handed on to it; notes each
    layer the engine asks about and each compression.

    Its records are ``inner``'s (``needs``, ``defaults``, ``name``), so the engine runs ``inner``
    exactly as without the recorder; it has no hyperparameters of its own (no init field), and
    ``record_trace`` stores the unwrapped policy's settings.
    """

    inner: Scorer = field(init=False, repr=False, compare=False)
    recording: "_Recording" = field(init=False, repr=False, compare=False)

    @classmethod
    def around(cls, inner: Scorer, recording: "_Recording") -> "TracingScorer":
        tracing = cls()
        tracing.inner, tracing.recording = inner, recording
        tracing.name, tracing.about, tracing.needs, tracing.defaults = inner.name, inner.about, inner.needs, inner.defaults
        return tracing

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        """The inner scorer's per-call hook, plus a callback that follows which prompt each cache
        row holds (``rows`` of ``Scorer.attach``'s callback) and reads what is due."""
        rec = self.recording
        if rec.attached:
            raise ValueError("a TraceRecorder records one generate call: call recorder.finish() before "
                             "generating again with the policy it wrapped (or wrap the policy again)")
        rec.attached = True
        with self.inner.attach(model, tokenizer) as yielded:
            inner = HostHooks.of(yielded)

            def on_tokens(token_ids, query_pos, rows):
                rec.follow(rows)
                if inner.on_tokens is not None:
                    inner.on_tokens(token_ids, query_pos, rows)

            def on_rows_leave(keep: torch.Tensor) -> None:
                """Cache rows not in ``keep`` are about to leave the batch: read every record still
                due while they are there (nothing is then lost to a row's departure)."""
                rec.flush()
                if inner.on_rows_leave is not None:
                    inner.on_rows_leave(keep)

            yield HostHooks(on_tokens=on_tokens, on_rows_leave=on_rows_leave)

    def should_compress(self, layer, budget):
        self.recording.flush()
        self.recording.number(layer)
        return self.inner.should_compress(layer, budget)

    def observe(self, layer, probs, query_pos, steps=False):
        self.recording.flush()
        return self.inner.observe(layer, probs, query_pos, steps)

    def score(self, layer, seen_tokens):
        return self.inner.score(layer, seen_tokens)

    def select(self, layer, scores, budget, seen_tokens):
        self.recording.flush()
        chosen = self.inner.select(layer, scores, budget, seen_tokens)
        self.recording.compressed(layer, seen_tokens)
        return chosen

    def sized(self, horizon, feed, budget=None):
        """The inner scorer's peak, and with a budget its fitted copy, still traced (LagKV)."""
        inner, peak = self.inner.sized(horizon, feed, budget)
        return (self if inner is self.inner else TracingScorer.around(inner, self.recording)), peak


class TraceRecorder:
    """Record one generation's evictions.

    Usage::

        recorder = TraceRecorder()
        result = generate(model, tokenizer, [prompt], recorder.wrap(policy), config)
        trace = recorder.finish(meta={"text": result.texts[0]})
    """

    def __init__(self):
        self.recording = _Recording(Trace())

    def wrap(self, policy: Policy) -> Policy:
        if policy.scorer is None:
            raise ValueError("method 'full' evicts nothing: trace a method with a budget")
        return replace(policy, scorer=TracingScorer.around(policy.scorer, self.recording))

    def finish(self, meta: dict[str, Any] | None = None) -> Trace:
        """Read what is still due and return the trace (the recorder starts a new one)."""
        self.recording.flush()
        trace = self.recording.trace
        trace.meta.update(meta or {})
        trace.meta.setdefault("layers", len(self.recording.layers))
        self.recording = _Recording(Trace())
        return trace


def draw_heatmap(trace: Trace, path: str | Path, row: int = 0, layer: int | None = None,
                 head: int | None = None) -> Path:
    """Kept-token heatmap: positions across, compression events down (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, matrix = trace.kept_fraction(row, layer, head)
    if not steps:
        raise ValueError("the trace has no compression events for this row: raise --max-new-tokens or lower --budget")
    fig, ax = plt.subplots(figsize=(9, 5))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")  # white: not generated yet
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=1,
                      extent=(-0.5, matrix.shape[1] - 0.5, len(steps) - 0.5, -0.5))
    prompt = trace.meta.get("prompt_tokens")
    if prompt:
        ax.axvline(prompt - 0.5, color="red", linewidth=0.8, linestyle="--", label=f"end of prompt ({prompt})")
        ax.legend(loc="lower left", fontsize=8)
    ticks = np.linspace(0, len(steps) - 1, num=min(8, len(steps))).round().astype(int)
    ax.set_yticks(ticks, [str(steps[t]) for t in ticks])
    ax.set_xlabel("token position")
    ax.set_ylabel("compression event (tokens seen)")
    which = ("all layers" if layer is None else f"layer {layer}") + ("" if head is None else f", kv head {head}")
    label = trace.meta.get("method", "")
    ax.set_title(f"kept tokens: {label} ({which})")
    shared = "kv heads" if layer is not None else "(layer, kv head) pairs"
    fig.colorbar(image, ax=ax, label=f"share of {shared} keeping the token" if head is None else "kept")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def record_trace(model, tokenizer, messages, policy: Policy, config, meta: dict[str, Any] | None = None) -> Trace:
    """Generate for one prompt under ``policy`` and return its eviction trace."""
    from ..generate import generate

    recorder = TraceRecorder()
    result = generate(model, tokenizer, [messages], recorder.wrap(policy), config)
    stat = result.stats[0]
    return recorder.finish({**(meta or {}), "method": policy.name, "settings": policy.settings(), "text": result.texts[0],
                            "prompt_tokens": stat.prompt_tokens, "generated_tokens": stat.generated_tokens,
                            "compression_events": stat.compression_events})
