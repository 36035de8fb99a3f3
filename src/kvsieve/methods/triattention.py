"""TriAttention: score keys by the distance preference that the pre-RoPE query centre predicts.

arXiv:2604.04921; official code: github.com/WeianMao/triattention.

Based on Mao et al., "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression"
(arXiv:2604.04921).  Before RoPE, the queries of a head sit close to a fixed non-zero centre
(Q/K concentration).  Cut a head's D dimensions into F = D/2 RoPE frequency pairs, each a
complex number (rotate-half layout: real part dimension f, imaginary part f + F).  RoPE turns
pair f of the query at position p_q and of the key at p_k by w_f p_q and w_f p_k, so a query
at the centre, q_bar, gives the key k its logit as a trigonometric series of their distance:

    logit(delta) = s^2 sum_f |q_bar_f| |k_f| cos(w_f delta + phi_f),  phi_f = arg(q_bar_f conj(k_f)),   (Eq. 4)

with s RoPE's attention scaling (1 for plain RoPE) and delta = p_q - p_k.  The score of a
cached key at a compression at position t (the row's next position) averages the series over
future queries at t + o, o in {1, 2, 4, ..., 2^16}, and adds a norm term for the part of the
queries the centre does not explain, weighted by one minus the mean resultant length
R_f = |E q_f| / E|q_f| of each pair (E|q_f| - |E q_f| = E|q_f| (1 - R_f)):

    score(k) = mean_o [ S_trig(k, t + o) + S_norm(k) ]                                 (Eqs. 10-11)
    S_trig(k, t + o) = logit(t + o - p_k)                                                 (Eq. 6)
    S_norm(k) = s^2 sum_f (E|q_f| - |q_bar_f|) |k_f|                                      (Eqs. 8-9)

then a z-score per query head and the max over each kv head's query group (Eqs. 12-13).  The
score is the official code's ``score_keys_for_round`` over ``compute_frequency_statistics_from_means``
(triattention/methods/pruning_utils.py).  Caveat on the equation numbers: the stored copies of the
paper hold only its abstract and introduction; the numbers are those two independent summaries of
the full paper agree on (issue 51), not read from the paper here.

How kvsieve computes it: no RoPE inversion is needed.  kvsieve stores post-RoPE keys
k~_f = s k_f e^{i w_f p_k} (``SieveLayer.keys``), so

    |q_bar_f||k_f| cos(w_f delta + phi_f) = Re(q_bar_f conj(k_f) e^{i w_f delta})
                                          = Re(q_bar_f conj(k~_f) e^{i w_f (t + o)}) / s,

the key's own position cancels, and the mean over offsets is the factor c_f = mean_o e^{i w_f o}.
Each query head's whole series is then one real vector u = s q_bar e^{i w t} c (as 2F reals)
and the series of every key is one product u . k~ ([B, H_kv, G, D] @ [B, H_kv, D, cap]); the
norm term is (E|q| - |q_bar|) . |k~_f| * s, |k~_f| = s |k_f|.  Per query head the scores are
z-normalised over the live tokens, then reduced over each kv head's query group by the max.

The statistics (q_bar, E|q|, the RoPE frequencies w and scaling s, the model's fingerprint)
come from ``kvsieve calibrate triattention`` (``kvsieve.analysis.qk``); ``stats=FILE`` names
them.  A file made for another model is refused, naming both (as a steering vector is).

What the budget holds, by default the official runner's (triattention/scripts/worker.py, the
paper's runs: ``count_prompt_tokens=True``, ``allow_prefill_compression=False``): the prompt is
kept and counts inside the budget (``Policy.pin_prompt``), so generated tokens compete for
``budget - prompt`` slots (a prompt of ``budget`` tokens or more keeps its first ``budget``), and
no recent window or sink is protected (compute_keep_indices has none).  kvsieve's earlier reading,
the prompt kept outside the budget and a recent window of min(128, budget // 2), stays as
``protect_prompt=true recent=...`` (stage 4 of the accuracy grid ran it).

The z-score (Eqs. 12-13) runs over the generated tokens only when the prompt is kept (protected
or pinned: ``normalize_over="decode"``, the official ``compute_keep_indices``: "Apply
normalization only on decode tokens"), over every live token when the prompt competes;
``normalize_over="live"`` always normalises over every live token, protected ones included
(kvsieve's earlier reading; the vLLM runtime does this, selector_hf.py::_finalize_layer_scores).

Pruning modes (``pruning``):
* ``per_head`` (the default: official ``per_head_pruning=True`` in scripts/worker.py, the
  paper's runs; vLLM runtime/config.py ``pruning_mode="per_head"``): kv head h keeps the same
  tokens in every layer, chosen by the mean over layers of each layer's group max
  (triattention/methods/triattention.py::_select_per_head_independent).  kvsieve's schedule
  scores every layer, averages, and applies one keep-set to all (``Needs.cross_layer``,
  ``Schedule.compress_across_layers``).
* ``per_layer_per_head``: each (layer, kv head) keeps its own tokens, by the max over its query
  group (official ``per_layer_perhead_pruning`` with ``layer_perhead_aggregation="max"``,
  ``_select_per_layer_perhead_independent``).
* ``per_layer``: every kv head of a layer keeps the same tokens, by the max over all the
  layer's query heads: kvsieve's own mode.  It is not the official vLLM runtime's ``per_layer``
  mode, which first averages each group's query statistics into one set per kv head and scores
  with those (selector_hf.py::_build_reduced_layer_stats, the mean over the group of ``q_abs_mean``
  and ``q_mean_complex``).
# deviation: the official runner adds uniform noise of 1e-6 (seed 0) to every score to break ties;
# kvsieve breaks ties by position, the newer token kept (schedule.ranked; its scores are fp32 means, ties are rare).
# deviation: the official runner prunes once the cache reaches budget + 128 (its slack trigger), so its
# first compression falls at decode step budget + 128 - prompt; kvsieve compresses every `interval` (128)
# decode steps while a layer holds more than the budget: the same period and peak (budget + 128), its first
# compression at decode step 128 instead.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from ..cache import DEAD_POS
from ..checks import check_fields
from ..policy import About, Defaults, Needs, Scorer, check_choice, register
from ..model_files import load_saved, save_file, other_model

# Offsets of the future queries: 1, 2, 4, ..., 65536 (official code pruning_utils.py::build_geometric_offsets
# up to offset_max_length=65536: scripts/worker.py --triattention_frequency_window, vLLM core/config.py)
OFFSET_MAX = 65536
INTERVAL = 128  # divide_length=128: scripts/worker.py, scripts/cli.py, vLLM runtime/config.py
PRUNING_MODES = ("per_head", "per_layer_per_head", "per_layer")
NORMALIZE_OVER = ("decode", "live")
STATS_HINT = "make one with: kvsieve calibrate triattention --model MODEL --data FILE --out stats.pt"


class StatsModelError(ValueError):
    """A TriAttention statistics file used with a model other than the one it was calibrated on."""


@dataclass
class QueryStats:
    """Pre-RoPE query statistics of every (layer, query head), per RoPE frequency pair.

    q_mean : [L, H_q, F, 2] float32, the centre E[q_f] as (real, imaginary)
    q_abs_mean : [L, H_q, F] float32, E|q_f|
    inv_freq : [F] float64, RoPE's w_f;  attention_scaling : s
    """

    q_mean: torch.Tensor
    q_abs_mean: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float
    num_kv_heads: int
    model_name: str
    fingerprint: dict
    settings: dict = field(default_factory=dict)

    def __post_init__(self):
        check_fields(self)
        L, H, F, two = self.q_mean.shape
        if two != 2 or self.q_abs_mean.shape != (L, H, F) or self.inv_freq.shape != (F,):
            raise ValueError(f"inconsistent TriAttention statistics: q_mean {tuple(self.q_mean.shape)}, q_abs_mean "
                             f"{tuple(self.q_abs_mean.shape)}, inv_freq {tuple(self.inv_freq.shape)}")
        if self.num_kv_heads < 1 or H % self.num_kv_heads:
            raise ValueError(f"{H} query heads do not split into {self.num_kv_heads} kv heads")
        for name in ("q_mean", "q_abs_mean", "inv_freq"):
            bad = int((~torch.isfinite(getattr(self, name))).sum())
            if bad:
                raise ValueError(f"TriAttention statistics have {bad} of {getattr(self, name).numel()} values in {name} "
                                 f"that are not finite (nan or inf); calibrate again ({STATS_HINT})")
        if not math.isfinite(self.attention_scaling):
            raise ValueError(f"TriAttention statistics have attention_scaling {self.attention_scaling}, not finite; "
                             f"calibrate again ({STATS_HINT})")

    def save(self, path: str | Path) -> None:
        """Write the statistics to ``path`` (``model_files.save_file``: a full disk is an ``OSError``)."""
        save_file({"kind": "kvsieve-triattention-stats", **asdict(self)}, path)

    @classmethod
    def read(cls, path: str | Path) -> "QueryStats":
        """The statistics saved at ``path``, not yet checked against a model (``check``)."""
        data = load_saved(path, "TriAttention statistics", STATS_HINT)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or data.pop("kind", None) != "kvsieve-triattention-stats" or set(data) != names:
            raise ValueError(f"{path} is not a TriAttention statistics file; {STATS_HINT}")
        try:
            return cls(**data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    def heads_part(self, part: int, parts: int) -> "QueryStats":
        """The statistics of the ``part``-th of ``parts`` equal slices of the heads, in order: the
        query and kv heads one tensor-parallel worker holds (vLLM splits both in contiguous
        slices, a kv head's query group with it)."""
        H = self.q_mean.shape[1]
        if parts < 1 or not 0 <= part < parts or self.num_kv_heads % parts:
            raise ValueError(f"TriAttention statistics of {self.num_kv_heads} kv heads do not split into {parts} "
                             "equal parts (one per tensor-parallel worker); serve with a tensor-parallel size that "
                             "divides the kv heads")
        heads = slice(part * H // parts, (part + 1) * H // parts)
        return replace(self, q_mean=self.q_mean[:, heads], q_abs_mean=self.q_abs_mean[:, heads],
                       num_kv_heads=self.num_kv_heads // parts)

    def check(self, model, source: str | Path = "") -> "QueryStats":
        """Refuse statistics calibrated on another model (by name and shape); returns ``self``."""
        other = other_model(self.model_name, self.fingerprint, model)
        where = f" {source}" if source else ""
        if other:
            raise StatsModelError(f"TriAttention statistics{where} were {other}; calibrate this model (kvsieve "
                                  "calibrate triattention --model ...)")
        c = model.config
        L, H, F, _ = self.q_mean.shape
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        have, want = (L, H, self.num_kv_heads, 2 * F), (c.num_hidden_layers, c.num_attention_heads, kv_heads, head_dim)
        if have != want:
            shape = "{} layers, {} query heads, {} kv heads, head dim {}"
            raise StatsModelError(f"TriAttention statistics{where} hold {shape.format(*have)}; the model has "
                                  f"{shape.format(*want)}; calibrate this model (kvsieve calibrate triattention "
                                  "--model ...)")
        return self


def turns(angle: torch.Tensor) -> torch.Tensor:
    """e^{i angle}, complex128."""
    return torch.polar(torch.ones((), dtype=torch.float64), angle.double())


def offset_mean(inv_freq: torch.Tensor, offset_max: int = OFFSET_MAX) -> torch.Tensor:
    """c_f = mean over o in {1, 2, 4, ..., offset_max} of e^{i w_f o}: [F] complex128."""
    offsets = 2.0 ** torch.arange(int(math.log2(offset_max)) + 1, dtype=torch.float64)  # [O]
    return turns(offsets[:, None] * inv_freq.double()).mean(dim=0)


def series_scores(keys: torch.Tensor, q_mean: torch.Tensor, q_abs_mean: torch.Tensor, inv_freq: torch.Tensor,
                  scaling: float, seen_tokens: torch.Tensor, offset_max: int = OFFSET_MAX) -> torch.Tensor:
    """Eqs. 10-11 (S_trig + S_norm, averaged over the offsets) for every query head and cached key:
    [B, H_kv, G, cap].

    keys [B, H_kv, cap, D] post-RoPE; q_mean [H_q, F, 2]; q_abs_mean [H_q, F]; inv_freq [F];
    seen_tokens [B] the rows' next positions t."""
    B, H, cap, D = keys.shape
    F = D // 2
    G = q_mean.shape[0] // H
    centre = torch.complex(q_mean[..., 0].double(), q_mean[..., 1].double())  # [H_q, F]
    turn = turns(seen_tokens.double()[:, None] * inv_freq.double())  # [B, F]: e^{i w t}
    u = scaling * centre[None] * (turn * offset_mean(inv_freq, offset_max))[:, None]  # [B, H_q, F] complex
    u = torch.cat([u.real, u.imag], dim=-1).float().view(B, H, G, D)  # Re(u conj(k~)) = u_re k_re + u_im k_im
    keys = keys.float()
    trig = u @ keys.transpose(-1, -2)  # [B, H, G, cap]
    pair_norm = (keys[..., :F].square() + keys[..., F:].square()).sqrt()  # [B, H, cap, F]: |k~_f| = s |k_f|
    spread = scaling * (q_abs_mean.float() - centre.abs().float()).view(1, H, G, F)  # s (E|q_f| - |q_bar_f|)
    return trig + spread @ pair_norm.transpose(-1, -2)  # [B, H, G, cap]


def z_normalise(scores: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std per query head over the live slots [B, H, cap] (population std, at least
    1e-6: official triattention/methods/triattention.py::compute_keep_indices, normalize_scores)."""
    live = live[:, :, None].to(scores.dtype)  # [B, H, 1, cap]
    count = live.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = (scores * live).sum(dim=-1, keepdim=True) / count
    std = (((scores - mean) * live).square().sum(dim=-1, keepdim=True) / count).sqrt().clamp(min=1e-6)
    return (scores - mean) / std


@register("triattention")
@dataclass
class TriAttention(Scorer):
    """Trigonometric distance preference of the pre-RoPE query centre, plus a norm term (Eqs. 4-13).

    Parameters
    ----------
    stats : str
        The statistics file of ``kvsieve calibrate triattention`` (required).
    pruning : str, default "per_head"
        "per_head", "per_layer_per_head" or "per_layer" (module docstring).
    normalize : bool, default True
        z-normalise each query head's scores before the group max (official
        ``triattention_normalize_scores=True``: scripts/worker.py; vLLM runtime/config.py
        ``sparse_normalize_scores=True``).
    normalize_over : str, default "decode"
        "decode": over the generated tokens when the prompt is kept, every live token otherwise
        (official compute_keep_indices); "live": over every live token (module docstring).
    offset_max : int, default 65536
        Largest future offset; offsets are 1, 2, 4, ... up to it (official
        pruning_utils.py::build_geometric_offsets, ``offset_max_length=65536``).  The series is
        averaged over them (official ``score_aggregation="mean"``; its "max" is not offered: the
        mean is what lets one product per layer score every key).
    """

    about = About("trigonometric series of the pre-RoPE query centres at each key's distance, plus a Q/K norm "
                  "term; calibrated statistics (stats=FILE)",
                  "Mao et al. 2026 (arXiv:2604.04921); offsets, normalisation, per_head, prompt inside the budget, "
                  "every 128: official code (scripts/worker.py)")
    # per-token scores (their z-normalisation reads the live set, never slot order): evicted in place
    needs = Needs(slot_order_free=True)
    # the official runner's semantics (module docstring): prompt pinned inside the budget (scripts/worker.py
    # count_prompt_tokens=True, allow_prefill_compression=False), no recent window or sinks (compute_keep_indices
    # protects none), every 128 decode steps (divide_length=128), compressed only while decoding
    # (methods/triattention.py::triattention_forward compresses on decode steps only)
    defaults = Defaults(interval=INTERVAL, pin_prompt=True, compress_prefill=False)
    stats: str = ""
    pruning: str = "per_head"
    normalize: bool = True
    normalize_over: str = "decode"
    offset_max: int = OFFSET_MAX
    _stats: QueryStats | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_choice(self.pruning, PRUNING_MODES, "triattention pruning")
        check_choice(self.normalize_over, NORMALIZE_OVER, "triattention normalize_over")
        if self.offset_max < 1:
            raise ValueError(f"triattention offset_max must be >= 1, got {self.offset_max}")
        if not self.stats:
            raise ValueError(f"triattention needs its calibrated statistics: stats=FILE ({STATS_HINT})")
        self._stats = QueryStats.read(self.stats)
        # per_layer: the max over the layer's kv heads of their scores (``score``)
        self.needs = replace(self.needs, aligned_heads=self.pruning == "per_layer",
                             heads_combined_by="max" if self.pruning == "per_layer" else "",
                             cross_layer=self.pruning == "per_head")

    def for_heads(self, part: int, parts: int) -> "TriAttention":
        """This scorer for the ``part``-th of ``parts`` slices of the heads (a tensor-parallel
        worker's, ``QueryStats.heads_part``): the same settings, the statistics of those heads."""
        scorer = copy.copy(self)  # not replace(): its __post_init__ would read the file again
        scorer._stats = self._stats.heads_part(part, parts)
        return scorer

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        """Refuse statistics calibrated on another model before anything runs."""
        self._stats.check(model, self.stats)
        yield None

    def score(self, layer, seen_tokens):
        st = self._stats
        keys = layer.keys  # [B, H_kv, cap, D] post-RoPE
        B, H, cap, D = keys.shape
        L, Hq, F, _ = st.q_mean.shape
        if layer.layer_idx >= L or 2 * F != D or H != st.num_kv_heads:
            raise StatsModelError(f"TriAttention statistics {self.stats} ({L} layers, {st.num_kv_heads} kv heads, head "
                                  f"dim {2 * F}) do not fit layer {layer.layer_idx} ({H} kv heads, head dim {D})")
        dev = keys.device
        per_query = series_scores(keys, st.q_mean[layer.layer_idx].to(dev), st.q_abs_mean[layer.layer_idx].to(dev),
                                  st.inv_freq.to(dev), st.attention_scaling, seen_tokens, self.offset_max)
        if self.normalize:
            per_query = z_normalise(per_query, self.normalized_slots(layer))
        # the max over the query group (layer_perhead_aggregation="max"); per_head's mean over layers is the schedule's
        per_kv = per_query.amax(dim=2)  # [B, H, cap]
        if self.pruning == "per_layer":
            return per_kv.amax(dim=1, keepdim=True).expand_as(per_kv)
        return per_kv

    def normalized_slots(self, layer) -> torch.Tensor:
        """[B, H_kv, cap] bool: the slots each query head's z-score runs over: live slots, and of
        those only the generated tokens when the prompt is kept (``normalize_over="decode"``, the
        layer knowing each row's prompt, ``LayerReader.prompt_len``)."""
        pos = layer.meta["pos"]
        live = pos != DEAD_POS
        if self.normalize_over == "live" or layer.prompt_len is None:
            return live
        return live & (pos >= layer.prompt_len[:, None, None])
