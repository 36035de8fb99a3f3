"""Sentences as token ids (SkipKV App. A.1), shared by SkipKV's scorer (``skipkv.py``) and its
adaptive steering (``kvsieve.steering``).

Based on Tian et al., "SkipKV: Selective Skipping of KV Generation and Storage for Efficient
Inference with Large Reasoning Models" (arXiv:2512.07993); official code
github.com/TTTTTTris/SkipKV.

A sentence ends at (and includes) a token of the newline delimiter set D; a sentence holding a
token of the keyword set N is a non-execution thought ("Others").  Both sets are token texts,
turned into vocabulary ids once per tokenizer (``vocab_ids``).  ``sentence_spans`` cuts one
token list into sentences on the host; ``OthersCounter`` counts each row's closed Others
sentences on the device while decoding (Alg. 2 lines 5-7, 26).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..cache import DEAD_POS

DELIMITERS = ("\n", ".\n", ")\n", "\n\n", ".\n\n", ")\n\n")  # App. A.1, newline delimiter set D
KEYWORDS = ("Wait", "Alternatively", "again")  # App. A.1, non-executable keyword set N


@functools.lru_cache(maxsize=16)
def _cached_vocab(tokenizer) -> tuple[str, ...]:
    return tuple(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))


def _decoded_vocab(tokenizer) -> tuple[str, ...]:
    """Each vocabulary id's text (0.3 s for 49k tokens; cached per tokenizer object)."""
    try:
        return _cached_vocab(tokenizer)
    except TypeError:  # an unhashable tokenizer class
        return _cached_vocab.__wrapped__(tokenizer)


def vocab_ids(tokenizer, texts: Sequence[str], strip: bool = False, contains: bool = False) -> torch.Tensor:
    """Ids of vocabulary tokens whose decoded text equals one of ``texts`` (``strip``: after
    removing surrounding whitespace, so " Wait" matches "Wait"; ``contains``: holds one)."""
    wanted = set(texts)
    vocab = _decoded_vocab(tokenizer)
    if contains:
        hits = [i for i, t in enumerate(vocab) if any(w in t for w in wanted)]
    else:
        hits = [i for i, t in enumerate(vocab) if (t.strip() if strip else t) in wanted]
    return torch.tensor(hits, dtype=torch.long)


def sentence_spans(token_ids: list[int], delimiters: set[int]) -> list[tuple[int, int]]:
    """Closed sentences [start, end] (end = the delimiter, inclusive) of a token list (App. A.1)."""
    spans, start = [], 0
    for i, tok in enumerate(token_ids):
        if tok in delimiters:
            spans.append((start, i))
            start = i + 1
    return spans


class OthersCounter:
    """Per-row count N_o of closed sentences labelled Others (Alg. 2 lines 5-7, 26), updated
    from each forward's tokens without host syncs.  State is indexed by original batch row."""

    def __init__(self, delimiter_ids: torch.Tensor, keyword_ids: torch.Tensor):
        self.delimiter_ids, self.keyword_ids = delimiter_ids, keyword_ids
        self.n_others: torch.Tensor | None = None  # [R] closed Others sentences
        self.open_has_keyword: torch.Tensor | None = None  # [R] the open sentence holds a keyword

    def counts(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] N_o of each row (the first call, with the whole batch, allocates the state)."""
        if self.n_others is None:
            self.n_others = torch.zeros(rows.numel(), dtype=torch.long, device=rows.device)
            self.open_has_keyword = torch.zeros_like(self.n_others, dtype=torch.bool)
        return self.n_others[rows]

    def update(self, token_ids: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor) -> None:
        """token_ids, query_pos: [B, T] (DEAD_POS on padding); rows: [B] original row ids."""
        self.counts(rows)
        B, T = token_ids.shape
        real = query_pos != DEAD_POS
        end = torch.isin(token_ids, self.delimiter_ids) & real
        keyword = torch.isin(token_ids, self.keyword_ids) & real
        segment = end.cumsum(1) - end.long()  # [B, T] sentence index inside this chunk; 0 = the open one
        hits = torch.zeros(B, T + 1, dtype=torch.long, device=token_ids.device).scatter_add_(1, segment, keyword.long())
        hits[:, 0] += self.open_has_keyword[rows].long()
        n_end = end.sum(1)  # [B]
        closed = torch.arange(T + 1, device=token_ids.device) < n_end[:, None]
        self.n_others[rows] += ((hits > 0) & closed).sum(1)
        self.open_has_keyword[rows] = hits.gather(1, n_end[:, None]).squeeze(1) > 0
