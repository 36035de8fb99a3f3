"""Expected Attention: score each key by the attention that future queries are expected to pay it.

arXiv:2510.00636; official code: github.com/NVIDIA/kvpress (ExpectedAttentionPress).

Based on Devoto, Jeblick & Jégou, "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution" (arXiv:2510.00636), the AMS paper's base scorer
[24] (AMS Table 10 and App. B.2: ``ExpectedAttentionPress(epsilon=1e-2)`` of kvpress, code
github.com/NVIDIA/kvpress).  The AMS paper names the scorer and its epsilon only; the rest
follows [24] and the kvpress press it used:

* queries are Gaussian, q ~ N(mu, Sigma), mean and covariance of the recent pre-RoPE queries of
  each query head (the hidden-state buffer, AMS Table 15: 256 tokens), sink positions left out;
* a future query at position p is R_p q, so over the next ``n_future`` positions its mean is
  R_bar mu and covariance R_bar Sigma R_bar^T, with R_bar the average RoPE rotation;
* for a Gaussian q, E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2) (s the softmax scale,
  1/sqrt(d)): these logits are softmax-normalised over the cached keys (sinks excluded),
  averaged over each kv head's query group and rescaled by the value norm:
  ``score = (a + epsilon) * ||v||``.

RoPE: kvsieve keeps post-RoPE queries and keys.  ``attach`` (entered by ``kvsieve.generate``)
reads the model's RoPE frequencies (the ``inv_freq`` buffer of its rotary embedding; rotate-half
layout of Llama/Qwen2/Mistral), so the recorded queries are rotated back to pre-RoPE and R_bar
is built from the next ``n_future`` positions of each row: the estimator of [24].  Scaled RoPE
factors cancel (queries and keys carry the same one); ``rope_theta`` overrides the model's
frequencies with standard RoPE of that base.  Called without a model and without
``rope_theta`` (hand-made caches), the window's post-RoPE queries are used as they are:
# deviation (fallback only): the mean and covariance then average RoPE over the window's own
# past positions instead of the next n_future ones.

Schedule: AMS's decode-only controller (App. B.2, Table 12): the prompt is prefilled whole and
the cache compressed every 512 generated tokens (Table 15).  No recent window is protected by
default (kvpress's press protects only its 4 sinks).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch

from ..cache import DEAD_POS
from ..policy import About, Defaults, Needs, Scorer, register
from ._common import row_chunks


def rotate_back(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos - rotate_half(x) * sin`` (rotate-half layout: R_{-p} x for the angles of p) as
    [x1 c + x2 s, x2 c - x1 s]: x cos, then each half's sine term added in place (a fused
    multiply-add where the CPU has one), without building rotate_half(x)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., half:])
    out[..., half:].addcmul_(x[..., :half], sin[..., :half], value=-1)
    return out


def standard_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim / 2] frequencies of unscaled RoPE with base ``theta``."""
    return theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def model_inv_freq(model) -> torch.Tensor | None:
    """The model's RoPE frequencies: the ``inv_freq`` buffer of its rotary embedding, if any."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq.detach().to(torch.float64)
    return None


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of RoPE at ``positions`` [...]: [..., 2 * len(inv_freq)] (rotate-half layout: both
    halves the same, each computed once)."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)  # [..., D/2]
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def query_statistics(queries: torch.Tensor, weight: torch.Tensor,
                     scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [B, H_q, D] and covariance [B, H_q, D, D] of queries [B, H_q, w, D] over the
    window entries with weight 1 (weight [B, w] in {0, 1}; biased estimate, as kvpress).  With
    every weight 1 the products by it, exact, are skipped.  ``scratch``: the queries are the
    caller's own copy, centred in place (the same numbers, one tensor of the window's size less)."""
    w = weight[:, None, :, None].to(queries.dtype)  # [B, 1, w, 1]
    count = w.sum(dim=2).clamp(min=1)  # [B, 1, 1]
    whole = bool(weight.all())
    mean = (queries if whole else queries * w).sum(dim=2) / count
    centered = queries.sub_(mean[:, :, None]) if scratch else queries - mean[:, :, None]
    if not whole:
        centered = centered * w
    cov = centered.transpose(-1, -2) @ centered / count[..., None]
    return mean, cov


def per_distinct_row(positions: torch.Tensor, fn):
    """``fn(positions)`` [B, ...] computed once per distinct row of ``positions`` [B, n] (the rows
    of a stack of one request's layers are alike) and given back to every row."""
    distinct, row_of = torch.unique(positions, dim=0, return_inverse=True)
    if distinct.shape[0] == positions.shape[0]:
        return fn(positions)
    return tuple(t[row_of] for t in fn(distinct))


def gaussian_logits(queries: torch.Tensor, weight: torch.Tensor, keys: torch.Tensor, scaling: float,
                    use_covariance: bool, angles: tuple | None) -> torch.Tensor:
    """log E[exp(s q.k)] = s mu.k + s^2 k^T Sigma k / 2 [B, H, G, cap] for each key of ``keys``
    [B, H, cap, D] and q ~ N(mu, Sigma) of the window's post-RoPE queries [B, H_q, w, D] (weight as
    ``query_statistics``).  ``angles``: cos, sin [B, w, D] of the queries' positions and cos_bar,
    sin_bar [B, D] averaged over the future positions, or None (queries used as they are)."""
    B, H, cap, D = keys.shape
    if angles is not None:
        cos, sin, cos_bar, sin_bar = angles
        queries = rotate_back(queries, cos[:, None], sin[:, None])  # pre-RoPE: R_{-p} q_p, our own copy
        # k^T R_bar: the logits of R_bar mu and R_bar Sigma R_bar^T
        keys = rotate_back(keys, cos_bar[:, None, None], sin_bar[:, None, None])
    mean, cov = query_statistics(queries, weight, scratch=angles is not None)  # [B, H_q, D], [B, H_q, D, D]
    G = mean.shape[1] // H
    mean, cov = mean.view(B, H, G, D), cov.view(B, H, G, D, D)
    logits = scaling * torch.einsum("bhgd,bhcd->bhgc", mean, keys)  # [B, H, G, cap]
    if use_covariance:
        logits = logits + scaling * scaling / 2 * torch.einsum("bhcd,bhgde,bhce->bhgc", keys, cov, keys)
    return logits


@register("expected")
@dataclass
class ExpectedAttention(Scorer):
    """Expected attention of future queries, times the value norm.

    Parameters
    ----------
    epsilon : float, default 1e-2
        Added to the expected attention before the value-norm rescaling (AMS Table 10, App.
        B.2: ``ExpectedAttentionPress(epsilon=1e-2)``; kvpress's own default is 0).
    n_future : int, default 512
        Future positions the RoPE rotation is averaged over (kvpress ``n_future_positions``).
    hs_buffer : int, default 256
        Recent queries the mean and covariance come from (AMS Table 15, App. B.2 HS buffer).
    sinks : int, default 4
        First positions left out of the statistics and of the softmax, and kept (kvpress
        ``n_sink=4``; AMS Table 15: 4 sinks).  Shared with the policy's ``sinks``.
    use_covariance, use_vnorm : bool, default True
        Covariance term of the logits; value-norm rescaling (kvpress defaults).
    rope_theta : float or None, default None
        None: the frequencies of the model ``generate`` runs (read in ``attach``); a number:
        standard RoPE with that base instead (module docstring).
    """

    about = About("expected attention of future queries (Gaussian, RoPE-averaged) times value norm",
                  "Devoto et al. 2025 (arXiv:2510.00636) via kvpress; epsilon 1e-2, HS buffer 256: AMS Table 10/15")
    # per-token scores: the engine may evict in place; the window's statistics, no attention rows
    needs = Needs(slot_order_free=True, stacks_layers=True, attends_window=False)
    # protect_prompt False (inherited): AMS App. B.2 "cap the per-layer cache length at T_keep", the prompt
    # included, as ``ams``; its Table 11 notes prompt-prefix protection for R-KV and RPC only
    defaults = Defaults(sinks=4, interval=512, compress_prefill=False)  # AMS App. B.2, Tables 12/15
    epsilon: float = 1e-2
    n_future: int = 512
    hs_buffer: int = 256
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    rope_theta: float | None = None
    _inv_freq: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.epsilon < 0 or self.n_future < 1 or self.hs_buffer < 1 or self.sinks < 0:
            raise ValueError(f"expected: need epsilon >= 0, n_future >= 1, hs_buffer >= 1 and sinks >= 0, got "
                             f"{self.epsilon}, {self.n_future}, {self.hs_buffer}, {self.sinks}")
        if self.rope_theta is not None and self.rope_theta <= 1:
            raise ValueError(f"expected: rope_theta must be the model's RoPE base (> 1), got {self.rope_theta}")
        # the statistics' queries; the values' norms rescale the scores (use_vnorm)
        self.needs = replace(self.needs, query_window=self.hs_buffer, reads_values=self.use_vnorm)

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        """For one generate call: the model's RoPE frequencies (unless ``rope_theta`` is set)."""
        self._inv_freq = model_inv_freq(model) if self.rope_theta is None else None
        try:
            yield None
        finally:
            self._inv_freq = None

    def frequencies(self, head_dim: int) -> torch.Tensor | None:
        """[head_dim / 2] RoPE frequencies, or None when neither a model nor rope_theta gives them."""
        inv_freq = standard_inv_freq(head_dim, self.rope_theta) if self.rope_theta is not None else self._inv_freq
        if inv_freq is not None and 2 * inv_freq.numel() != head_dim:
            raise ValueError(f"expected: the model's RoPE covers {2 * inv_freq.numel()} of {head_dim} head "
                             "dimensions; partial rotary embeddings are not supported")
        return inv_freq

    def score(self, layer, seen_tokens):
        queries = layer.recent_queries.float()  # [B, H_q, w, D] post-RoPE
        qpos = layer.recent_query_pos  # [B, w]
        keys, pos = layer.keys.float(), layer.meta["pos"]  # [B, H, cap, D], [B, H, cap]
        B, H, cap, D = keys.shape
        real = qpos != DEAD_POS
        # deviation: kvpress drops the first n_sink buffered hidden states ("outliers"): the sink
        # tokens in a prefill, the oldest buffered ones in decoding; here the sink positions' queries
        weight = real & (qpos >= self.sinks)
        weight = torch.where(weight.any(dim=1, keepdim=True), weight, real)  # only sinks seen: use them
        inv_freq = self.frequencies(D)
        angles = None
        if inv_freq is not None:
            cos, sin = per_distinct_row(qpos.masked_fill(~real, 0), lambda p: rope_angles(p, inv_freq))  # [B, w, D]
            # deviation: kvpress starts at the number of buffered hidden states, which in decoding is
            # not the row's position; [24] averages over the positions after the current one
            future = seen_tokens[:, None] + torch.arange(self.n_future, device=keys.device)  # [B, n_future]
            cos_bar, sin_bar = per_distinct_row(  # [B, D], the mean over the future positions
                future, lambda p: tuple(t.mean(dim=1) for t in rope_angles(p, inv_freq)))
            angles = cos, sin, cos_bar, sin_bar
        logits = keys.new_empty(B, H, queries.shape[1] // H, cap)
        for rows in row_chunks(B, queries[0].numel() * queries.element_size()):  # a few rows at a time, in cache
            logits[rows] = gaussian_logits(queries[rows], weight[rows], keys[rows], layer.scaling, self.use_covariance,
                                           None if angles is None else tuple(a[rows] for a in angles))
        scored = (pos != DEAD_POS) & (pos >= self.sinks)  # [B, H, cap]
        attn = logits.masked_fill(~scored[:, :, None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        scores = attn.mean(dim=2)  # average over the query group (kvpress)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * layer.values.float().norm(dim=-1)
        top = scores.masked_fill(~scored, float("-inf")).amax(dim=-1, keepdim=True).clamp(min=0)
        return torch.where(pos < self.sinks, top, scores)  # sinks get the max score (kvpress)
