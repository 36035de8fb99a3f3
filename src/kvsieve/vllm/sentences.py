"""SkipKV's sentences inside vLLM: one ``methods.skipkv.SentenceTable`` per worker, a row per live
request.  Plain torch: no vLLM import.

Based on Tian et al., "SkipKV: Selective Skipping of KV Generation and Storage for Efficient
Inference with Large Reasoning Models" (arXiv:2512.07993), App. A.1 (sentences end at a token of
the delimiter set D) and Eqs. 1-3 (a sentence's mean last-layer hidden state, compared by cosine
with every later one's: PSS).

kvsieve's engine feeds SkipKV's table from its decode loop (``SkipKV.attach``: each forward's
token ids and positions, then the final norm's output).  vLLM's worker runs one forward per step
over every scheduled request's tokens, flattened; ``RequestSentences.feed`` cuts that forward per
request (vLLM's ``query_start_loc``) and feeds each request's row the same three things: its
token ids, its logical positions and its last-layer hidden states, the requests with as many
tokens this step in one ``SentenceTable.feed``.  A row is cleared when its request leaves
(``forget``: finished, or resumed after a preemption, whose recompute feeds its prompt and
outputs again from position 0) and serves the next request.  Before a batch of requests is
scored at a compaction, ``select`` points the table at their rows in the batch's order
(``store.compress_requests``' ``before_scoring``), where kvsieve's engine has the batch's rows.
"""

from __future__ import annotations

import torch

from ..methods._wrapper import WrappingScorer
from ..methods.skipkv import SentenceTable


def sentence_reader(scorer):
    """The scorer inside any wrappers (``ams:skipkv``: ``WrappingScorer.inner``) that reads the
    sentence table (``Needs.sentences``)."""
    while isinstance(scorer, WrappingScorer):
        scorer = scorer.inner
    return scorer


class RequestSentences:
    """The sentence table of a worker's live requests, each request's row found by its id."""

    def __init__(self, table: SentenceTable):
        self.table = table
        self.row_of: dict[str, int] = {}
        self.free: list[int] = []  # rows of requests that left, cleared

    def forget(self, req_id: str) -> None:
        """The request left: its row is cleared for the next request (a request resumed after a
        preemption recomputes from position 0 and is fed anew)."""
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.table.clear(row)
            self.free.append(row)

    def row(self, req_id: str) -> int:
        """The request's row, a free one (or a new one: the table doubles) the first time."""
        if req_id not in self.row_of:
            if self.free:
                self.row_of[req_id] = self.free.pop()
            else:  # every row below the high-water mark len(row_of) is in use
                row = len(self.row_of)
                if row >= self.table.num_rows:
                    self.table.add_rows(max(row + 1, 2 * self.table.num_rows))
                self.row_of[req_id] = row
        return self.row_of[req_id]

    def feed(self, req_ids: list[str], starts: list[int], token_ids: torch.Tensor, positions: torch.Tensor,
             hidden: torch.Tensor) -> None:
        """One forward of vLLM: request ``req_ids[i]``'s tokens are ``token_ids[starts[i]:starts[i + 1]]``
        (flattened [N], ``starts`` of length R + 1), at logical ``positions`` [N], with last-layer
        hidden states ``hidden`` [N, d]."""
        groups: dict[int, list[tuple[int, int]]] = {}  # tokens this step -> (row, first token) per request
        for i, req_id in enumerate(req_ids):
            n = starts[i + 1] - starts[i]
            if n > 0:
                groups.setdefault(n, []).append((self.row(req_id), starts[i]))
        for n, members in groups.items():
            rows = torch.tensor([row for row, _ in members])
            at = torch.tensor([first for _, first in members])[:, None] + torch.arange(n)  # [B, n]
            self.table.feed(token_ids[at].long(), positions[at].long(), rows, hidden[at])

    def select(self, req_ids: list[str]) -> None:
        """Score the rows of ``req_ids`` next, in that order (a batch about to be compacted)."""
        unseen = [r for r in req_ids if r not in self.row_of]
        if unseen:
            raise RuntimeError(f"kvsieve: request(s) {unseen} are compacted before any of their tokens was fed to "
                               "the sentence table")
        self.table.select(torch.tensor([self.row_of[r] for r in req_ids]))
