"""Pre-RoPE query/key statistics of every head: TriAttention's calibration and its Q/K analysis.

``calibrate`` (``kvsieve calibrate triattention``) runs the model over plain text with full
attention, takes each layer's post-RoPE queries and keys at the attention call (after any
q/k norm, exactly what RoPE saw), rotates them back by their positions (RoPE inverted:
pair f of position p turned by -w_f p, divided by RoPE's attention scaling s) and keeps, per
(layer, query head) and frequency pair f, the centre E[q_f] and the mean norm E|q_f|: what
TriAttention's score (``kvsieve.methods.triattention``, Eqs. 4-13) reads, saved with the model's
RoPE frequencies and fingerprint.

# deviation: the official calibration (scripts/calibrate.py) runs one forward pass over a long
# text (up to 32,768 tokens, bf16); here the text is cut into chunks of ``chunk`` tokens (1,024
# by default, 4,096 in all: a CPU's budget), each run alone from position 0, in the model's dtype.
# It also rebuilds the queries from ``q_proj`` and RoPE, which leaves out a q norm (Qwen3's);
# taking them at the attention call keeps it.

``analyze`` (``kvsieve analyze qk``) measures, per head:

* the Q/K concentration: how tightly pre-RoPE queries (keys) cluster around their centre, as
  the norm-weighted mean resultant length  R = sum_f |E x_f| / sum_f E|x_f|  (1: every vector
  of the head equals its centre in every pair's direction; 0: no common direction);
* the distance preference the centres predict: the series
  s^2 sum_f |q_bar_f| |k_bar_f| cos(w_f d + arg(q_bar_f conj(k_bar_f))) at distance d, against
  the mean attention logit the head really gives a key d tokens back, with their Pearson
  correlation (and the same against the mean softmax weight at distance d, which the causal
  softmax also shapes: a query sees fewer keys near the start of a chunk).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..methods.expected import model_inv_freq
from ..methods.triattention import QueryStats, turns
from ..model_files import model_fingerprint, model_name

CAPTURE = "kvsieve_qk"  # the attention implementation that records queries and keys
TEXT_FIELDS = ("question", "problem", "answer", "solution", "text")


def read_texts(path: str | Path, limit: int | None = None) -> list[str]:
    """Plain texts from ``path``: a JSONL file (each row's question/problem, answer/solution or text
    fields joined; GSM8K-train rows give question and answer), else the whole file as one text."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration data {path} is not a file")
    if path.suffix != ".jsonl":
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"calibration data {path} is empty")
        return [text]
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number} is not a JSON line") from None
            parts = [str(row[k]) for k in TEXT_FIELDS if isinstance(row, dict) and k in row]
            if not parts:
                raise ValueError(f"{path}:{number} has none of the fields {list(TEXT_FIELDS)}")
            texts.append("\n".join(parts))
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ValueError(f"calibration data {path} has no rows")
    return texts


def leading_tokens(tokenizer, texts: list[str], tokens: int) -> torch.Tensor:
    """The first ``tokens`` token ids of ``texts`` joined by blank lines (fewer if they are shorter),
    tokenising only as many texts as that takes (a few characters a token; doubled until enough)."""
    chars = 6 * tokens
    while True:
        total, count = 0, 0
        while count < len(texts) and total < chars:
            total, count = total + len(texts[count]) + 2, count + 1
        ids = tokenizer("\n\n".join(texts[:count]), return_tensors="pt").input_ids[0]
        if ids.numel() >= tokens or count == len(texts):
            return ids[:tokens]
        chars *= 2


def model_rope(model) -> tuple[torch.Tensor, float]:
    """The model's RoPE frequencies w [D/2] (float64) and attention scaling s."""
    inv_freq = model_inv_freq(model)
    if inv_freq is None:
        raise ValueError(f"{model_name(model)} has no rotary embedding (inv_freq): TriAttention needs RoPE")
    scaling = next((float(m.attention_scaling) for m in model.modules() if hasattr(m, "attention_scaling")), 1.0)
    return inv_freq, scaling


def pre_rope_pairs(x: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Post-RoPE vectors x [H, T, D] at positions 0..T-1 back to pre-RoPE frequency pairs [H, T, D/2]
    (complex128): pair f = x_f + i x_{f+F}, turned by -w_f p and divided by s (RoPE inverted)."""
    F = x.shape[-1] // 2
    pairs = torch.complex(x[..., :F].double(), x[..., F:].double())
    positions = torch.arange(x.shape[-2], dtype=torch.float64, device=x.device)
    return pairs * turns(-positions[:, None] * inv_freq.to(x.device)) / scaling


@dataclass
class Moments:
    """Running sums over tokens of pre-RoPE pairs per (layer, head, pair): sum x_f and sum |x_f|."""

    total: torch.Tensor  # [L, H, F] complex128
    abs_total: torch.Tensor  # [L, H, F] float64
    count: int = 0

    @classmethod
    def zeros(cls, layers: int, heads: int, pairs: int) -> "Moments":
        return cls(torch.zeros(layers, heads, pairs, dtype=torch.complex128), torch.zeros(layers, heads, pairs,
                                                                                           dtype=torch.float64))

    def add(self, layer: int, pairs: torch.Tensor) -> None:
        """pairs [H, T, F] of one chunk (the token count is added once per chunk by the caller)."""
        self.total[layer] += pairs.sum(dim=1).cpu()
        self.abs_total[layer] += pairs.abs().sum(dim=1).cpu()

    def centre(self) -> torch.Tensor:
        return self.total / max(self.count, 1)  # [L, H, F] E[x_f]

    def mean_norm(self) -> torch.Tensor:
        return self.abs_total / max(self.count, 1)  # [L, H, F] E|x_f|

    def concentration(self) -> torch.Tensor:
        """[L, H] norm-weighted mean resultant length sum_f |E x_f| / sum_f E|x_f| (module docstring)."""
        return self.centre().abs().sum(dim=-1) / self.mean_norm().sum(dim=-1).clamp(min=1e-30)


class Capture:
    """Queries and keys of every attention call, taken at transformers' attention function (post-RoPE,
    [H, T, D] of a batch of one), turned into pre-RoPE moments; optionally the mean logit and the
    mean attention weight per distance 0..``max_distance`` of every query head."""

    def __init__(self, model, max_distance: int = 0):
        config = model.config
        self.inv_freq, self.scaling = model_rope(model)
        layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
        pairs = self.inv_freq.numel()
        self.queries = Moments.zeros(layers, heads, pairs)
        self.keys = Moments.zeros(layers, kv_heads, pairs)
        self.max_distance = max_distance
        self.logit_sum = torch.zeros(layers, heads, max_distance + 1, dtype=torch.float64)
        self.weight_sum = torch.zeros_like(self.logit_sum)
        self.pair_count = torch.zeros(max_distance + 1, dtype=torch.float64)

    def attention(self, module, query, key, value, attention_mask=None, scaling=None, **kwargs):
        """An attention function (``AttentionInterface``): records, then runs sdpa."""
        layer = module.layer_idx
        self.queries.add(layer, pre_rope_pairs(query[0].float(), self.inv_freq, self.scaling))
        self.keys.add(layer, pre_rope_pairs(key[0].float(), self.inv_freq, self.scaling))
        if self.max_distance:
            self._by_distance(layer, query[0].float(), key[0].float(), scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def _by_distance(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Mean logit q_p . k_{p-d} and mean causal softmax weight at each distance d (one chunk)."""
        Hq, T, _ = query.shape
        key = key.repeat_interleave(Hq // key.shape[0], dim=0)  # [Hq, T, D]
        logits = query @ key.transpose(-1, -2)  # [Hq, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
        weights = (logits * scaling).masked_fill(~causal, float("-inf")).softmax(dim=-1)
        for d in range(min(self.max_distance, T - 1) + 1):
            self.logit_sum[layer, :, d] += logits.diagonal(offset=-d, dim1=-2, dim2=-1).sum(dim=-1).double().cpu()
            self.weight_sum[layer, :, d] += weights.diagonal(offset=-d, dim1=-2, dim2=-1).sum(dim=-1).double().cpu()
            if layer == 0:
                self.pair_count[d] += T - d

    @contextlib.contextmanager
    def installed(self, model):
        """The model attends through ``self.attention`` inside the ``with``."""
        AttentionInterface.register(CAPTURE, self.attention)
        previous = model.config._attn_implementation
        model.set_attn_implementation(CAPTURE)
        try:
            yield self
        finally:
            model.set_attn_implementation(previous)

    @torch.inference_mode()
    def run(self, model, tokenizer, texts: list[str], tokens: int, chunk: int) -> int:
        """Feed ``texts`` (joined by blank lines) in chunks of ``chunk`` tokens, ``tokens`` in all
        (fewer if the text is shorter); returns the tokens fed."""
        if tokens < 2 or chunk < 2:
            raise ValueError(f"tokens and chunk must be >= 2, got {tokens} and {chunk}")
        ids = leading_tokens(tokenizer, texts, tokens)
        device = next(model.parameters()).device
        fed = 0
        with self.installed(model):
            for start in range(0, ids.numel(), chunk):
                piece = ids[start:start + chunk]
                if piece.numel() < 2:
                    break
                model(piece[None].to(device), use_cache=False)
                self.queries.count += piece.numel()
                self.keys.count += piece.numel()
                fed += piece.numel()
        return fed


def calibrate(model, tokenizer, texts: list[str], tokens: int = 4096, chunk: int = 1024,
              data: str = "") -> QueryStats:
    """TriAttention's statistics of ``model`` from ``texts`` (module docstring)."""
    capture = Capture(model)
    fed = capture.run(model, tokenizer, texts, tokens, chunk)
    centre = capture.queries.centre()
    return QueryStats(q_mean=torch.stack([centre.real, centre.imag], dim=-1).float(),
                      q_abs_mean=capture.queries.mean_norm().float(), inv_freq=capture.inv_freq.double(),
                      attention_scaling=capture.scaling, num_kv_heads=model.config.num_key_value_heads,
                      model_name=model_name(model), fingerprint=model_fingerprint(model),
                      settings={"data": data, "tokens": fed, "chunk": chunk, "texts": len(texts)})


def predicted_preference(q_centre: torch.Tensor, k_centre: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                         distances: torch.Tensor) -> torch.Tensor:
    """The series of the centres at each distance: [L, H_q, M] for centres [L, H_q, F] and
    [L, H_q, F] (keys repeated onto their query heads), distances [M]."""
    relative = q_centre * k_centre.conj()  # [L, H, F]: |q_bar||k_bar| e^{i phi}
    turn = turns(distances.double()[:, None] * inv_freq.double())  # [M, F]
    return scaling ** 2 * (relative[:, :, None, :] * turn).real.sum(dim=-1)


def pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correlation along the last dimension."""
    a, b = a - a.mean(dim=-1, keepdim=True), b - b.mean(dim=-1, keepdim=True)
    return (a * b).sum(dim=-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=1e-30)


def rounded(curve: torch.Tensor) -> list[float]:
    return [float(f"{x:.5g}") for x in curve.tolist()]


def analyze(model, tokenizer, texts: list[str], out: str | Path, tokens: int = 2048, chunk: int = 512,
            max_distance: int = 128, info: dict | None = None) -> dict:
    """Concentration and distance preference of every head; writes ``qk.json`` and ``qk.png`` in ``out``."""
    if not 1 <= max_distance < chunk:
        raise ValueError(f"max_distance must be between 1 and chunk - 1 ({chunk - 1}), got {max_distance}")
    capture = Capture(model, max_distance)
    fed = capture.run(model, tokenizer, texts, tokens, chunk)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    distances = torch.arange(max_distance + 1)
    predicted = predicted_preference(capture.queries.centre(), capture.keys.centre().repeat_interleave(group, dim=1),
                                     capture.inv_freq, capture.scaling, distances)  # [L, Hq, M]
    count = capture.pair_count.clamp(min=1)
    measured = capture.logit_sum / count  # [L, Hq, M]
    weights = capture.weight_sum / count
    r = pearson(predicted, measured)  # [L, Hq]
    r_weight = pearson(predicted, weights)  # the same against the mean softmax weight
    q_conc, k_conc = capture.queries.concentration(), capture.keys.concentration()
    summary = {**(info or {}), "tokens": fed, "chunk": chunk, "max_distance": max_distance,
               "q_concentration_mean": float(q_conc.mean()), "k_concentration_mean": float(k_conc.mean()),
               "correlation_median": float(r.median()), "correlation_mean": float(r.mean()),
               "weight_correlation_median": float(r_weight.median()),
               "heads": [{"layer": l, "head": h, "kv_head": h // group, "q_concentration": float(q_conc[l, h]),
                          "k_concentration": float(k_conc[l, h // group]), "correlation": float(r[l, h]),
                          "weight_correlation": float(r_weight[l, h]), "predicted_logit": rounded(predicted[l, h]),
                          "measured_logit": rounded(measured[l, h]), "measured_weight": rounded(weights[l, h])}
                         for l in range(r.shape[0]) for h in range(r.shape[1])]}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qk.json").write_text(json.dumps(summary))
    summary["png"] = str(plot(q_conc, k_conc, predicted, measured, r, out / "qk.png", info or {}))
    return summary


def plot(q_conc, k_conc, predicted, measured, r, path: Path, info: dict) -> Path:
    """Q and K concentration per head, the correlation per head, and four heads' curves (z-scored)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, values, title in ((axes[0, 0], q_conc, "Q concentration (mean resultant length)"),
                              (axes[0, 1], k_conc, "K concentration (mean resultant length)"),
                              (axes[0, 2], r, "corr(predicted, measured logit by distance)")):
        image = ax.imshow(values.T.numpy(), aspect="auto", origin="lower", cmap="viridis",
                          vmin=-1 if values is r else 0, vmax=1)
        ax.set(title=title, xlabel="layer", ylabel="head" if values is not k_conc else "kv head")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(image, ax=ax)
    flat = r.flatten()
    order = flat.argsort(descending=True)
    picks = [int(order[0]), int(order[len(order) // 3]), int(order[2 * len(order) // 3])]
    z = lambda x: (x - x.mean()) / x.std().clamp(min=1e-12)  # noqa: E731
    for ax, index in zip(axes[1], picks):
        l, h = divmod(index, r.shape[1])
        ax.plot(z(predicted[l, h]).numpy(), label="series of the centres")
        ax.plot(z(measured[l, h]).numpy(), label="measured mean logit")
        ax.set(title=f"layer {l} head {h}: r = {float(r[l, h]):.2f}", xlabel="distance (tokens)", ylabel="z-score")
        ax.legend()
    fig.suptitle(f"pre-RoPE Q/K concentration and distance preference: {info.get('model', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
