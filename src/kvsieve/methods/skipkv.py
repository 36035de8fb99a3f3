"""SkipKV: evict redundant *sentences* first, then tokens by importance minus redundancy.

arXiv:2512.07993; official code: github.com/TTTTTTris/SkipKV.

Based on Tian et al., "SkipKV: Selective Skipping of KV Generation and Storage for Efficient
Inference with Large Reasoning Models" (arXiv:2512.07993), Sec. 4.1, Alg. 1, App. A.1-A.2;
official code github.com/TTTTTTris/SkipKV.  Every 128 decode steps (compress_prefill off):

    I_final = sigma * I_alpha - (1 - sigma) * R - lambda_i * [i in P]        (Eq. 6)

I_alpha: observation-window attention, max over each kv group's query heads, softmax over keys,
mean over the window, max-pooled along the sequence (Eq. 4 and Sec. 4.1).  R: key redundancy
(Eq. 5).  P and lambda: sentence i is redundant when a *later* sentence j has cosine similarity
lambda_ij > tau between mean last-layer hidden states (Eqs. 1-3).  Tokens go in increasing
I_final, so redundant sentences go first and a sentence may be cut partway.

Sentences (App. A.1) end at a token of the delimiter set D and cover prompt and output, as in
Alg. 2.  The generation-space table (M^(gs), Eq. 13: start, hidden-state sum, token count per
sentence) lives in ``SentenceTable``, indexed by original batch row.  Each cached token carries
its sentence id as per-token metadata ``sent``, compacted with K/V by the engine's one gather:
that is the paper's cache-range map Phi (Eqs. 8-11) -- a sentence with no surviving token simply
has no slot left.  New tokens enter with ``sent = -1`` and are labelled at their layer's next
compression from the table's start positions, so decoding does no per-layer work.  PSS runs
over every sentence seen (M^(gs), evicted ones included), as Alg. 2 line 23 does; the table holds
d floats per sentence and row, and reads the device once each time its capacity bound runs out.

``SkipKV.attach`` (entered by ``kvsieve.generate``) turns D into token ids and reads the final
norm's output (the last-layer hidden states) with a read-only forward hook scoped to the call: no
second forward pass, nothing global.  Inside vLLM the worker feeds one table for all its
requests and hands it over with ``read_sentences`` (``kvsieve.vllm.sentences``).
(``output_hidden_states=-1`` would need the engine's model call to change and makes transformers
keep capture hooks on every decoder layer for the model's lifetime.)  If a wrapper does not
forward ``attach``, P stays empty and a warning says so.
Sentence token sets: ``_sentences.py`` (shared with adaptive steering, ``kvsieve.steering``);
batch grouping: ``kvsieve.data.batching``.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..attention import visible, window_attention
from ..cache import DEAD_POS
from ..hooks import HostHooks
from ..policy import About, Defaults, Needs, Scorer, check_choice, register
from ._common import pool_along_sequence
from ._keysim import PARTNER_THRESHOLD, check_threshold, rkv_redundancy, softmax_similarity_mean, unit_keys
from ._sentences import DELIMITERS, vocab_ids


class SentenceTable:
    """Sentences in generation space per original row r: ``start`` [R, S] (first position,
    DEAD_POS when unopened), ``total`` [R, S, d] and ``count`` [R, S] (hidden-state sums), ``open``
    [R] (the sentence in progress).  Grows by doubling; one host read per growth check.

    ``rows`` are the rows ``sentence_of`` and ``penalty`` read: the last ``feed``'s, or those a
    caller that feeds rows of its own ``select``s (kvsieve's vLLM worker: a row per live request,
    ``add_rows`` and ``clear`` as requests come and go, a compacted batch's rows selected)."""

    def __init__(self, delimiter_ids: torch.Tensor, capacity: int = 256):
        self.delimiter_ids, self.capacity = delimiter_ids, capacity
        self.open = self.start = self.total = self.count = self.rows = None
        self.num_rows = 0  # rows allocated at the first feed: at least that feed's batch
        self.bound = 0  # host-side upper bound on open.max()
        self.version = 0
        self._lam: tuple[tuple, torch.Tensor] | None = None

    @classmethod
    def of(cls, tokenizer, delimiters, device=None) -> "SentenceTable":
        """An empty table whose sentences end at ``tokenizer``'s ids of the texts ``delimiters`` (D)."""
        return cls(vocab_ids(tokenizer, delimiters).to(device))  # moved once, not per forward

    def feed(self, token_ids: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor):
        """token_ids, query_pos [B, T] (DEAD_POS on padding); rows [B]; hidden [B, T, d] last layer."""
        B, T, d = hidden.shape
        if self.open is None:
            R, dev = max(self.num_rows, rows.numel()), hidden.device
            self.num_rows = R
            self.open = torch.zeros(R, dtype=torch.long, device=dev)
            self.start = torch.full((R, self.capacity), DEAD_POS, dtype=torch.long, device=dev)
            self.count, self.total = torch.zeros(R, self.capacity, device=dev), torch.zeros(R, self.capacity, d, device=dev)
        self._reserve(T)
        real = query_pos != DEAD_POS
        end = torch.isin(token_ids, self.delimiter_ids) & real
        sid = self.open[rows][:, None] + end.cumsum(1) - end.long()  # [B, T] a sentence includes its delimiter
        flat = (rows[:, None] * self.capacity + sid).reshape(-1)
        weight = real.float().reshape(-1)
        self.total.view(-1, d).index_add_(0, flat, hidden.reshape(-1, d).float() * weight[:, None])  # Eq. (2) sums
        self.count.view(-1).index_add_(0, flat, weight)
        self.start.view(-1).scatter_reduce_(0, flat, query_pos.reshape(-1), "amin")
        self.open[rows] += end.sum(1)
        self.rows, self.version = rows, self.version + 1

    def _reserve(self, T: int) -> None:
        if self.bound + T >= self.capacity:
            self.bound = int(self.open.max())  # host read, only when the bound runs out
            if self.bound + T >= self.capacity:
                extra = max(self.capacity, self.bound + T + 1 - self.capacity)
                self.start = F.pad(self.start, (0, extra), value=DEAD_POS)
                self.count, self.total = F.pad(self.count, (0, extra)), F.pad(self.total, (0, 0, 0, extra))
                self.capacity += extra
        self.bound += T

    def add_rows(self, n: int) -> None:
        """At least ``n`` rows, the new ones empty (the first feed allocates them)."""
        extra = n - self.num_rows
        if extra <= 0:
            return
        if self.open is not None:
            self.open = F.pad(self.open, (0, extra))
            self.start = F.pad(self.start, (0, 0, 0, extra), value=DEAD_POS)
            self.count, self.total = F.pad(self.count, (0, 0, 0, extra)), F.pad(self.total, (0, 0, 0, 0, 0, extra))
        self.num_rows = n

    def clear(self, row: int) -> None:
        """Row ``row`` empty again, no sentence seen (its request left; the row serves another)."""
        if self.open is not None:
            self.open[row], self.start[row], self.count[row], self.total[row] = 0, DEAD_POS, 0, 0
            self.version += 1

    def select(self, rows: torch.Tensor) -> None:
        """Read the rows ``rows`` [B] next (``sentence_of``, ``penalty``), in that order; a row may
        repeat (vLLM's worker scores a stack of layers as rows of one request each)."""
        self.rows = rows

    def sentence_of(self, pos: torch.Tensor) -> torch.Tensor:
        """Sentence id of each position [B, H, C] of the current rows (meaningless on dead slots)."""
        B = pos.shape[0]
        ids = torch.searchsorted(self.start[self.rows], pos.reshape(B, -1), right=True) - 1
        return ids.view_as(pos).clamp(min=0)

    def penalty(self, tau: float, min_tokens: int) -> torch.Tensor:
        """[B, S] lambda_i for sentences in P (Eq. 3), 0 elsewhere: computed once per distinct row,
        cached until new tokens arrive or other rows are read."""
        distinct, row_of = torch.unique(self.rows, return_inverse=True)
        key = (self.version, tau, min_tokens, tuple(distinct.tolist()))
        if self._lam is None or self._lam[0] != key:
            count, S = self.count[distinct], self.capacity
            emb = F.normalize(self.total[distinct] / count.clamp(min=1)[..., None], dim=-1)
            sim = emb @ emb.transpose(1, 2)  # [B, S, S] PSS: Eq. 1's dot product of normalised v_i = cosine
            idx = torch.arange(S, device=sim.device)
            ok = (idx < self.open[distinct][:, None]) & (count >= min_tokens)  # closed sentences
            # i strictly earlier than j: Eq. 3 prints i <= j, but lambda_ii = 1 > tau would flag every
            # sentence; the text ("the earlier sentence i is flagged ..., the later one j is retained") pairs two
            pair = ok[:, :, None] & ok[:, None, :] & (idx[:, None] < idx[None, :])
            # deviation: with several later partners j, lambda_i is the largest lambda_ij (paper: unspecified)
            best = sim.masked_fill(~pair, float("-inf")).amax(-1)
            self._lam = (key, torch.where(best > tau, best, torch.zeros_like(best)))
        return self._lam[1][row_of]


@register("skipkv")
@dataclass
class SkipKV(Scorer):
    """Sentence-redundancy-first eviction.

    Parameters
    ----------
    sigma : float, default 0.1
        Importance/redundancy trade-off of Eq. 6 (App. A.2; official scripts also 0.1).
    tau : float, default 0.95
        PSS threshold of Eq. 3 (App. A.2 selects it in [0.95, 0.99]; Sec. 4.1's example 0.95).
    window : int, default 8
        Observation window alpha; also the protected recent tokens (paper silent; code ``window_size=8``).
    kernel : int, default 7
        Max-pool along the sequence of I_alpha (paper silent; code ``kernel_size=7``).
    group_pool : str, default "logits"
        "logits": max over the group's scores, then softmax (Sec. 4.1 text and official code);
        "probs": Eq. 4's probabilities max-pooled, then a second softmax (Eq. 4 read literally).
    redundancy : str, default "eq5"
        "eq5": mean over rows of the row-softmax of key cosines (Eq. 5's order of operations);
        "rkv": softmax of each key's mean cosine (R-KV / official code order).  Dead slots
        (padding, Eq. 5's mask M) take no part.  Deviation from Eq. 5 as printed, in both modes:
        a key's similarity to itself (the diagonal of K-bar K-bar^T, always 1) is left out: R-KV,
        which Eq. 5 follows ("Inspired by R-KV"), scores a key against the *other* keys (its code
        zeroes that cosine).  Kept in, it would add most to the redundancy of the keys least
        similar to the others.
    partner_threshold : float or None, default 0.5
        Cosine above which a key's last (latest) partner is exempted: its cosine in K-bar K-bar^T
        is set to 0 before either aggregation (official code ``skipkv/utils.py``
        ``cal_similarity_multi_batch(threshold=0.5, retain_direction="last")``, called by
        ``SkipKV.update_kv``).  Deviation from Eq. 5, which has no threshold: the code is
        followed.  None: Eq. 5 as printed, kvsieve's earlier reading.
    min_sentence_tokens : int, default 2
        Shorter sentences take no part in PSS (official code skips one-token ranges).
    delimiters : tuple of str
        The delimiter set D (App. A.1), matched against each token's full decoded text.
    """

    about = About("drops sentences a later sentence repeats, then importance minus key redundancy",
                  "Tian et al. 2025 (arXiv:2512.07993) Sec. 4.1, App. A.1-A.2: sigma 0.1, tau 0.95-0.99, every "
                  "128 steps; window 8 and kernel 7 from the official code")
    # sent: each token's sentence id; attach() yields on_tokens: the sentence table reads every new token
    # stacks_layers: the sentence table is read through the rows its feeder selects, a row per view row
    needs = Needs(meta={"sent": -1.0}, per_token_hook=True, stacks_layers=True, compares_keys=True)
    # protect_prompt False, the prompt competes for B: Sec. 4.3 Eq. 12 (padding of the prompt lowers the valid
    # budget, B' = B - pad) and the official code (skipkv/compression/skipkv.py update_kv cuts the whole
    # cache, prompt included, to B)
    defaults = Defaults(interval=128, compress_prefill=False, protect_prompt=False, recent_doc="window")
    sigma: float = 0.1
    tau: float = 0.95
    window: int = 8
    kernel: int = 7
    group_pool: str = "logits"
    redundancy: str = "eq5"
    partner_threshold: float | None = PARTNER_THRESHOLD
    min_sentence_tokens: int = 2
    delimiters: tuple[str, ...] = DELIMITERS

    def __post_init__(self):
        if not (0.0 <= self.sigma <= 1.0 and -1.0 <= self.tau <= 1.0):
            raise ValueError(f"skipkv needs 0 <= sigma <= 1 and -1 <= tau <= 1, got {self.sigma}, {self.tau}")
        if self.window < 1 or self.kernel < 1 or self.min_sentence_tokens < 1:
            raise ValueError("skipkv window, kernel and min_sentence_tokens must be >= 1")
        check_choice(self.group_pool, ("logits", "probs"), "skipkv group_pool")
        check_choice(self.redundancy, ("eq5", "rkv"), "skipkv redundancy")
        check_threshold(self.partner_threshold, "skipkv partner_threshold")
        self.sentences: SentenceTable | None = None
        self.defaults = replace(self.defaults, recent=self.window)  # the window's own tokens are kept
        self.needs = replace(self.needs, query_window=self.window, sentences=tuple(self.delimiters))

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        """For one generate call: sentence table, and a read of the final norm's output."""
        self.sentences = SentenceTable.of(tokenizer, self.delimiters, model.device)
        pending = []

        def on_tokens(token_ids, query_pos, rows):
            pending[:] = [(token_ids, query_pos, rows)]

        def read_hidden(module, args, output):
            self.sentences.feed(*pending.pop(), output)

        handle = model.get_decoder().norm.register_forward_hook(read_hidden)
        try:
            yield HostHooks(on_tokens=on_tokens)
        finally:
            handle.remove()

    def read_sentences(self, table: SentenceTable) -> None:
        """Score with ``table`` from now on, fed and selected by the caller instead of ``attach``
        (kvsieve's vLLM worker: one table for its requests, a compacted batch's rows selected)."""
        self.sentences = table

    def importance(self, layer, live):
        """[B, H_kv, cap] I_alpha (Eq. 4, Sec. 4.1): GQA max over the group, softmax, window mean."""
        qpos = layer.recent_query_pos  # [B, w]
        allowed = visible(layer.meta["pos"], qpos)  # [B, H, w, cap]
        # deviation: Eq. 4 softmaxes each query head before the group max, and "softmax(maxpool(A))"
        # would then softmax probabilities again (flattening I to near uniform); the official code
        # takes the group max of the scores and one softmax: "logits" does that, "probs" is literal.
        # The official softmax also leaves out the window's own keys; here every visible key counts.
        if self.group_pool == "logits":
            q, k = layer.recent_queries.float(), layer.keys.float()
            B, Hq, w, D = q.shape
            H = k.shape[1]
            scores = (q.reshape(B, H, (Hq // H) * w, D) @ k.transpose(-1, -2)).view(B, H, Hq // H, w, -1)
            pooled = scores.amax(2) * layer.scaling
        else:
            pooled = window_attention(layer).amax(2)
        attn = pooled.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        real = (qpos != DEAD_POS).float()  # padding queries do not vote
        mean = (attn * real[:, None, :, None]).sum(2) / real.sum(1).clamp(min=1)[:, None, None]
        return pool_along_sequence(mean, live, self.kernel, "max")

    def key_redundancy(self, layer, live):
        """[B, H_kv, cap] R of Eq. 5 over live keys (``redundancy="rkv"``: R-KV's form)."""
        unit = unit_keys(layer.keys, live)  # K-bar
        # deviation: Eq. 5 softmaxes K-bar K-bar^T as is; the official code (cal_similarity_multi_batch)
        # first zeroes each key's cosine to its last partner above 0.5, and so does kvsieve
        if self.redundancy == "eq5":  # row-softmax over the others, then the mean over rows (Eq. 5)
            return softmax_similarity_mean(unit, live, threshold=self.partner_threshold)
        return rkv_redundancy(unit, live, self.partner_threshold)

    def label(self, layer) -> torch.Tensor:
        """Write the sentence id of newly appended live slots into ``meta['sent']``; return it."""
        pos, sent = layer.meta["pos"], layer.meta["sent"]
        todo = (sent < 0) & (pos != DEAD_POS)
        layer.meta["sent"] = torch.where(todo, self.sentences.sentence_of(pos).float(), sent)
        return layer.meta["sent"]

    def score(self, layer, seen_tokens):
        live = layer.live()
        token_level = self.sigma * self.importance(layer, live) - (1 - self.sigma) * self.key_redundancy(layer, live)
        if self.sentences is None or self.sentences.rows is None:  # driven without attach(): P is empty
            warnings.warn("skipkv runs without its attach() hook (not through kvsieve.generate, or a wrapper "
                          "that does not forward attach()): no sentence is known, only the token-level score "
                          "of Eq. 6 is used", RuntimeWarning, stacklevel=2)
            return token_level
        sent = self.label(layer).long().clamp(min=0)  # [B, H, cap]
        lam = self.sentences.penalty(self.tau, self.min_sentence_tokens)  # [B, S]
        penalty = lam.gather(1, sent.flatten(1)).view_as(sent)  # lambda_ij on the tokens of i in P
        return token_level - penalty  # Eq. (6)
