"""The vLLM adapter of kvsieve's store protocol (``kvsieve.engine``): the paged KV of the requests
the scheduler compresses in one step, as the schedule reads it.  Plain torch: no vLLM import.

The requests of one step that keep the same count are compressed together (``_Batch``), each a row
of one read-only ``engine.LayerReader`` (a ``cache.LayerView``) per layer: keys gathered dense,
``[R, H_kv, S, D]``, from every request's blocks in one gather (``paged.gather_rows``; a shorter
request's padding slots are dead), values too where the scorer reads them (``Needs.reads_values``);
each slot's logical position and each per-token field the scorer declares (``Needs.meta``), kept
per request between compactions (``RequestState``); each request's recorded post-RoPE queries
(``rings.QueryRecorder``) where the scorer declares ``Needs.query_window``. kvsieve's own
schedule then chooses every row's kept slots at once (``schedule.keep_set``: the scorer,
``protected_scores``'s sinks, recent window and protected prompt, the top ``keep`` or the scorer's
own ``select``), with the count the scheduler fixed, equal in every (layer, kv head) (one block
table per request: AMS Appendix E), and one gather and one scatter per layer move them, within the
blocks, into each request's first slots (``paged.compact_rows``), the positions and fields moving
with them; for a scorer blind to slot order (``Needs.slot_order_free``) only the kept tokens beyond
the count move, into the evicted slots below it, as kvsieve's in-place eviction moves them
(``hole_moves``, ``paged.move_slots``). No method's math is written here.

Scorers that observe attention rows get them recomputed here from the recorded queries: the
newest row alone for TOVA (``Needs.observes_last_only``, batched), every row since the last
compaction for H2O, LazyEviction and RaaS (``observe_since``: the prompt's in one call, the
decode queries' in another, the requests that replay alike together).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..attention import attention_probs, visible
from ..cache import DEAD_POS, LayerView
from ..schedule import cross_layer_scores, keep_set, protected_scores
from .paged import Layout, block_table, compact_rows, gather_rows, move_slots
from .plan import Compaction


# The most one scoring's largest tensor (keys, attention rows or a key similarity: ``layer_bytes``)
# may take: of every stacked layer at once (``_Batch.stacks``), or of one layer's rows where those
# alone take more (``split_rows``).
# Stacking pays where a compaction is many small calls: one request on SmolLM2-135M (30 layers)
# compacts in about half the time with 4 MiB stacks (13 layers of 0.3 MiB); 16 requests (5 MiB a
# layer) gain nothing and lose with larger stacks, whose tensors outgrow the cache
# (scripts/compaction_bench.py, results/compaction-stacked.json).  Splitting pays where one layer's
# rows take more: H2O's replayed rows of 64 requests (12 MiB a layer) take about twice as long
# per element as those of 32, each new tensor that large being fresh pages from the system
# (glibc's mmap and trim thresholds), and 64 requests' keys (8 MiB) gather slower than twice 32's
# (docs/vllm-design.md, "Rows split").  With batches split, 8 MiB beats 4 (AMS over TOVA at 16
# requests 775 -> 637 ms, Expected Attention 697 -> 631) and 12 or 16 MiB (AMS 895, 882 ms); the
# rest are within a few percent from 4 to 16 MiB (1, 16 and 64 requests).
STACK_BYTES = 8 * 2**20
# The window queries of a scorer that only reads them, a few rows at a time (``Needs.attends_window``
# False: Expected Attention's statistics, AMS's mass), count this fraction of their bytes against
# STACK_BYTES: they are read once in chunks, where attention rows and key similarities are written
# and read again whole.
QUERIES_READ_SHARE = 4


class Rings(Protocol):
    """The recorded post-RoPE queries of live requests (``rings.QueryRecorder``; ``HeldRings``)."""

    def held(self, req_id: str) -> int:
        """Queries the request's ring holds."""
        ...

    def rows(self, layers: range, req_ids: list[str], n: int) -> torch.Tensor:
        """The last ``n`` queries of each request in a run of layers, oldest first, head-major (as
        scorers read them, ``LayerView.recent_queries``): [len(layers) * R, H_q, n, D], layer-major."""
        ...

    def heads(self) -> int:
        """H_q, the query heads of each recorded query."""
        ...


@dataclass
class HeldRings:
    """Rings held as tensors: ``queries[req_id]`` [L, H_q, n, D] each request's last n queries per
    layer, oldest first, head-major as the worker's recorder keeps them (one request's, for
    ``compress_request``; tests)."""

    queries: dict[str, torch.Tensor]

    def held(self, req_id: str) -> int:
        return self.queries[req_id].shape[2]

    def rows(self, layers: range, req_ids: list[str], n: int) -> torch.Tensor:
        parts = [self.queries[r][layers.start:layers.stop, :, self.held(r) - n:] for r in req_ids]  # [n_l, H_q, n, D]
        return torch.stack(parts, dim=1).flatten(0, 1)

    def heads(self) -> int:
        return next(iter(self.queries.values())).shape[1]


@dataclass
class RequestState:
    """What the worker keeps of one request between compactions: the logical position ``pos`` and
    the scorer's declared per-token fields ``fields[name]`` of the ``kept`` first slots, each
    [L, H_kv, kept], from its last compaction; the slots appended since run on from ``next_pos``
    in order, with each field's initial value (``Needs.meta``)."""

    pos: torch.Tensor | None = None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    next_pos: int = 0

    @property
    def kept(self) -> int:
        return 0 if self.pos is None else self.pos.shape[-1]

    def positions(self, kv_len: int, layers: int, heads: int) -> torch.Tensor:
        """[L, H_kv, kv_len] the logical position of every slot."""
        tail = torch.arange(self.next_pos, self.next_pos + kv_len - self.kept).expand(layers, heads, -1)
        return tail if self.pos is None else torch.cat([self.pos, tail], dim=-1)

    def field(self, name: str, init: float, kv_len: int, layers: int, heads: int) -> torch.Tensor:
        """[L, H_kv, kv_len] float32 per-token field ``name``: kept values, then ``init`` on appended slots."""
        tail = torch.full((layers, heads, kv_len - self.kept), float(init))
        return tail if name not in self.fields else torch.cat([self.fields[name], tail], dim=-1)


def observe_since(scorer, layer: LayerView, queries: torch.Tensor, logical_len: torch.Tensor, since: torch.Tensor,
                  prompt_len: torch.Tensor) -> None:
    """Hand ``scorer.observe`` the attention rows of each request's queries at positions ``since``
    .. ``logical_len - 1`` (those after its last compaction), as kvsieve's engine does: a prompt's
    (positions below ``prompt_len``) in one call, then the decode queries, every row of the batch
    at once: all of them in one call (``steps=True``) where the scorer takes steps so
    (``Needs.observes_steps``: H2O, LazyEviction, RaaS), else one call per query.  The rows replay
    alike (``replay_shape``): rows whose prompt queries start and end at the same positions (a
    first compaction), or rows with as many decode queries each.

    queries: [R, H_q, n, D] each request's last n recorded queries, oldest first, at positions
    ``logical_len - n`` .. ``logical_len - 1`` (logical_len, since, prompt_len: [R]); each call's
    rows are [R, H_kv, G, T, S].  Each call sees the layer as it was then: slots appended after
    the call's query are dead (their position DEAD_POS), so a scorer's ``live()`` and its writes
    leave them at their initial state."""
    R, n = queries.shape[0], queries.shape[2]
    first = logical_len - n  # [R] the position of each request's oldest recorded query
    if n == 0 or bool((since < first).any()):
        raise RuntimeError(f"kvsieve: {scorer.name} observes the queries from position {since.tolist()} on, but only "
                           f"the last {n} of {logical_len.tolist()} were recorded")
    pos = layer.meta["pos"]  # [R, H_kv, S]
    rows = torch.arange(R)
    if bool((since < prompt_len).any()):  # rows alike in since, prompt and length: the prompt's rows in one call
        if any(bool((t != t[0]).any()) for t in (since, prompt_len, logical_len)):
            raise RuntimeError("kvsieve: prompts' queries are replayed together only from and to the same positions")
        start, end = int(since[0]), int(min(prompt_len[0], logical_len[0]))
        query = queries[:, :, start - int(first[0]):end - int(first[0])]  # [R, H_q, T, D]
        _observe_then(scorer, layer, pos, query, torch.arange(start, end).expand(R, -1), torch.full((R,), end))
    decode_from = torch.maximum(since, prompt_len)  # [R]
    steps = max(0, int((logical_len - decode_from)[0]))  # none while a prompt is read in chunks
    if steps and scorer.needs.observes_steps:  # every decode query in one call, causal by position
        at = decode_from[:, None] + torch.arange(steps)  # [R, T]
        query = queries.take_along_dim((at - first[:, None])[:, None, :, None], dim=2)  # [R, H_q, T, D]
        allowed = visible(pos, at, layer.sliding_window)  # [R, H_kv, T, S]
        scorer.observe(layer, attention_probs(query, layer.keys, allowed, layer.scaling), at, steps=True)
        return
    for step in range(steps):
        at = decode_from + step  # [R] each request's query position in this call
        query = queries[rows, :, at - first][:, :, None]  # [R, H_q, 1, D]
        _observe_then(scorer, layer, pos, query, at[:, None], at + 1)


def _observe_then(scorer, layer: LayerView, pos: torch.Tensor, query: torch.Tensor, qpos: torch.Tensor,
                  end: torch.Tensor) -> None:
    """One observe call: the rows of ``query`` [R, H_q, T, D] at positions ``qpos`` [R, T], over
    the layer as it was when row r held the positions below ``end[r]`` (later slots dead)."""
    then = dataclasses.replace(layer, meta={**layer.meta, "pos": pos.masked_fill(pos >= end[:, None, None], DEAD_POS)})
    allowed = visible(then.meta["pos"], qpos, layer.sliding_window)  # [R, H_kv, T, S]: causal by position
    scorer.observe(then, attention_probs(query, layer.keys, allowed, layer.scaling), qpos)
    layer.meta.update({name: t for name, t in then.meta.items() if name != "pos"})  # fields a scorer replaced


def observe_last(scorer, layer: LayerView, last: torch.Tensor, seen: torch.Tensor) -> None:
    """Hand ``scorer.observe`` each row's newest attention row, for a scorer that keeps only that
    one (``Needs.observes_last_only``, TOVA): last [R, H_q, D] each request's newest query, at
    position ``seen - 1`` ([R]); every slot of a request is at or before it, its padding dead."""
    qpos = (seen - 1)[:, None]  # [R, 1]
    allowed = visible(layer.meta["pos"], qpos, layer.sliding_window)  # [R, H_kv, 1, S]
    scorer.observe(layer, attention_probs(last[:, :, None], layer.keys, allowed, layer.scaling), qpos)


def replays(policy) -> bool:
    """Whether the policy's scorer replays every query since a request's last compaction (H2O,
    LazyEviction, RaaS: ``observe_since``), not only the newest (TOVA: ``observe_last``)."""
    needs = policy.scorer.needs
    return needs.observes and not needs.observes_last_only


def replay_shape(state: RequestState, c: Compaction) -> tuple[int, ...]:
    """What a request's replay looks like, the same for requests replayed together: how many
    queries it replays and, where some are its prompt's (its first compaction), the positions its
    replay starts at, its prompt ends at and its queries end at, which ``observe_since`` replays
    alike only when they are the same in every row."""
    count = c.logical_len - state.next_pos
    return (count,) if state.next_pos >= c.prompt_len else (count, state.next_pos, c.prompt_len, c.logical_len)


class PartlyWritten(RuntimeError):
    """A batch failed while its kept slots were being written: its requests' KV is part old, part new."""


def compress_requests(policy, layout: Layout, caches: list[torch.Tensor], scalings: list[float],
                      requests: list[tuple[RequestState, Compaction]], rings: Rings | None,
                      stack_bytes: int = STACK_BYTES,
                      before_scoring: Callable[[list[str]], None] | None = None,
                      combine: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, str]:
    """Compress this step's requests of one policy in place, each to its ``c.keep`` tokens per
    (layer, kv head): requests that keep the same count and hold as many recorded queries are
    compressed together (``_Batch``: per layer one gather and one write for all of them, and one
    scoring for all of them and, where the scorer allows, for several layers: ``_Batch.stacks``
    under ``stack_bytes``, 0 for one layer and every row at a time; where one layer's rows alone
    take more than ``stack_bytes``, in batches of fewer requests: ``split_rows``); a replaying
    scorer's requests also replay as many queries, a prompt's from and to the same positions
    (``replay_shape``), and a scorer whose rows read each other (``Needs.rows_coupled``: AMS's
    batch segmentation) has its requests compressed one at a time.

    One request must not fail the others (a server serves them all): a batch scores every layer
    before it writes any, so a batch that fails while scoring has changed nothing and its requests
    are tried again one by one.  Returns the requests that could not be compressed, each with the
    reason: their KV is as it was (or, where a write failed, part old and part new), and the
    caller ends them.

    policy: the ``kvsieve.policy.Policy`` served; caches: every layer's KV cache tensor, read
    through ``layout``; scalings: each layer's softmax scale; requests: each request's positions
    and fields (updated to its kept slots) and its compaction; rings: the requests' recorded
    queries (None when the scorer reads none); before_scoring: called with the request id of every
    row about to be scored, in row order (a stack of n layers: the batch's ids n times), before
    they are scored (the worker selects their rows of SkipKV's sentence table,
    ``sentences.RequestSentences.select``); combine: where tensor-parallel workers
    hold a layer's kv heads apart and the scorer combines them (``heads_combiner``), the
    combination of this worker's scores with the others'."""
    needs = policy.scorer.needs
    reads_queries = bool(needs.query_window or needs.observes)
    groups: dict[tuple, list[tuple[RequestState, Compaction]]] = {}
    for i, (state, c) in enumerate(requests):
        held = rings.held(c.req_id) if reads_queries else 0
        if needs.rows_coupled:  # rows that read each other: one request at a time
            key = (i,)
        elif replays(policy):  # rows that replay alike
            key = (c.keep, held if needs.query_window else 0, *replay_shape(state, c))
        else:
            key = (c.keep, held)
        groups.setdefault(key, []).append((state, c))
    failed: dict[str, str] = {}
    for group in groups.values():
        tries = split_rows(layer_bytes(policy, layout, caches, group, rings), group, stack_bytes)
        while tries:
            batch = tries.pop()
            try:
                _Batch(policy, layout, caches, batch).compress(scalings, rings, stack_bytes, combine, before_scoring)
            except Exception as err:  # noqa: BLE001: any failure is one request's, never the server's
                if len(batch) > 1 and not isinstance(err, PartlyWritten):
                    tries += [[one] for one in batch]
                else:
                    failed.update({c.req_id: f"{type(err).__name__}: {err}" for _, c in batch})
    return failed


def compress_request(policy, layout: Layout, caches: list[torch.Tensor], scalings: list[float],
                     state: RequestState, c: Compaction,
                     queries_of: Callable[[int], torch.Tensor | None]) -> None:
    """One request alone (``compress_requests`` with one): queries_of(layer) its recorded queries
    [n, H_q, D] in that layer, oldest first (None when the scorer reads none)."""
    queries = [queries_of(layer) for layer in range(len(caches))]
    rings = None if queries[0] is None else HeldRings({c.req_id: torch.stack(queries).transpose(1, 2)})
    failed = compress_requests(policy, layout, caches, scalings, [(state, c)], rings)
    if failed:
        raise RuntimeError(f"kvsieve: request {c.req_id} not compressed: {failed[c.req_id]}")


class _Batch:
    """R requests compressed together, each a row of one ``LayerView`` per layer: keys (and values
    if read) gathered from every request's blocks into [R, H_kv, S, D] (S: the longest KV length; a
    shorter request's padding slots are dead, at DEAD_POS and zero), its positions and fields
    beside them, its recorded queries as the row's recent queries.  kvsieve's schedule then scores
    every row at once (``schedule.keep_set``, a keep-set [R, H_kv, keep]) and one move per layer
    puts each request's kept slots into its own first slots (``paged.compact_rows``; for a
    slot-order-free scorer only those beyond ``keep``, into the evicted ones: ``hole_moves``), the
    slots' positions and fields moving with them.  Each request keeps its ``keep`` (the same in the
    batch); the count and the choice are per row, so a batch keeps what each request alone keeps.

    A scorer that reads nothing of a layer but its rows (``Needs.stacks_layers``) has several
    layers scored as one view of [n * R] rows, layer-major (``stacks``): one scoring for them all
    instead of one per layer.  A lone request's compaction costs the count of its small tensor
    calls (about 130 per layer for LazyEviction), which stacking cuts; many requests at once cost
    their data, which it does not (docs/vllm-design.md, "Layers stacked")."""

    def __init__(self, policy, layout: Layout, caches: list[torch.Tensor],
                 requests: list[tuple[RequestState, Compaction]]):
        self.policy, self.layout, self.caches = policy, layout, caches
        self.states, self.cs = [s for s, _ in requests], [c for _, c in requests]
        L, H = len(caches), caches[0].shape[1]
        R, S = len(self.cs), max(c.kv_len for c in self.cs)
        self.keep = self.cs[0].keep
        self.lengths = torch.tensor([c.kv_len for c in self.cs])  # [R]
        self.live = torch.arange(S)[None] < self.lengths[:, None]  # [R, S]
        self.table = block_table([c.block_ids for c in self.cs])  # [R, max blocks]
        self.seen = torch.tensor([c.logical_len for c in self.cs])  # [R]: each next token's position
        self.since = torch.tensor([st.next_pos for st in self.states])  # [R]: each last compaction's position
        needs = policy.scorer.needs
        # [L, R, H, S], contiguous: a run of layers is a run of rows (``read``)
        self.pos = torch.stack([pad(st.positions(c.kv_len, L, H), S, DEAD_POS)
                                for st, c in requests], dim=1).contiguous()
        self.fields = {name: torch.stack([pad(st.field(name, init, c.kv_len, L, H), S, init)
                                          for st, c in requests], dim=1).contiguous()  # [L, R, H, S]
                       for name, init in needs.meta.items()}
        self.prompts = prompts = torch.tensor([c.prompt_len for c in self.cs])  # [R]
        self.kept_prompt = prompts if policy.protect_prompt or policy.pin_prompt else None
        self.prompt_len = prompts if policy.protect_prompt else None
        self.pinned = prompts.clamp(max=policy.budget) if policy.pin_prompt else None

    def stacks(self, scalings: list[float], rings: Rings | None, stack_bytes: int) -> list[range]:
        """The layers scored together, as runs: one layer each, unless the scorer stacks layers
        (``Needs.stacks_layers``), when runs of one softmax scale hold as many layers as keep the
        largest scoring tensor of a run (n times one layer's, ``layer_bytes``) under ``stack_bytes``."""
        needs, L = self.policy.scorer.needs, len(self.caches)
        if not needs.stacks_layers or needs.cross_layer or stack_bytes <= 0:
            return [range(layer, layer + 1) for layer in range(L)]
        most = max(1, min(L, stack_bytes // layer_bytes(self.policy, self.layout, self.caches,
                                                        list(zip(self.states, self.cs)), rings)))
        runs, start = [], 0
        for layer in range(1, L + 1):
            if layer == L or layer - start == most or scalings[layer] != scalings[start]:
                runs.append(range(start, layer))
                start = layer
        return runs

    def read(self, layers: range, scaling: float, rings: Rings | None) -> LayerView:
        """Layers ``layers`` of every request as the scorer reads them (``engine.LayerReader``),
        [n * R] rows, layer-major, their attention rows observed."""
        policy, needs = self.policy, self.policy.scorer.needs
        n = len(layers)
        R, H, S = self.pos.shape[1:]
        keys, values = gather_rows(self.layout, self.caches[layers.start:layers.stop], self.table, self.live,
                                   values=needs.reads_values)  # [n * R, H, S, D]; values None unless read
        req_ids = [c.req_id for c in self.cs]
        seen, lengths = self.seen.repeat(n), self.lengths.repeat(n)  # [n * R]
        recent = recent_pos = None
        if needs.query_window:
            held = min(needs.query_window, rings.held(req_ids[0]))
            recent = rings.rows(layers, req_ids, held)  # [n * R, H_q, w, D]
            recent_pos = seen[:, None] - held + torch.arange(held)[None]  # [n * R, w]
        meta = {"pos": self.pos[layers.start:layers.stop].view(n * R, H, S),
                **{name: t[layers.start:layers.stop].view(n * R, H, S) for name, t in self.fields.items()}}
        kept_prompt = None if self.kept_prompt is None else self.kept_prompt.repeat(n)
        view = LayerView(keys, values, lengths[:, None].expand(n * R, H), meta, {}, recent, recent_pos, scaling, {},
                         layers.start, S, prompt_len=kept_prompt)
        if needs.observes_last_only:
            last = rings.rows(layers, req_ids, 1)[:, :, 0]  # [n * R, H_q, D]
            observe_last(policy.scorer, view, last, seen)
        elif needs.observes:  # rows that replay alike: each one's queries since its last compaction
            count = int(self.seen[0] - self.since[0])  # the same in every row (replay_shape)
            if any(rings.held(r) < count for r in req_ids):
                raise RuntimeError(f"kvsieve: {policy.scorer.name} replays {count} queries, more than were recorded")
            queries = rings.rows(layers, req_ids, count)  # [n * R, H_q, count, D]
            observe_since(policy.scorer, view, queries, seen, self.since.repeat(n), self.prompts.repeat(n))
        return view

    def scored(self, layers: range, scaling: float, rings: Rings | None, rows: list,
               combine: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[LayerView, torch.Tensor | None]:
        """The view of ``layers`` and, where tensor-parallel workers combine a layer's kv heads
        (``combine``: ``heads_combiner``), its protected scores [n * R, H, S] combined with the
        other workers'.  Every worker makes the collective, one that failed to score too (its part
        then NaN), so a batch fails on every worker alike and all retry the same requests: no
        worker is left waiting in a collective the others never make."""
        if combine is None:
            return self.read(layers, scaling, rings), None
        R, H, S = self.pos.shape[1:]
        view, error = None, None
        part = torch.full((len(layers) * R, H, S), float("nan"))
        try:
            view = self.read(layers, scaling, rings)
            seen, prompt_len, pinned = rows
            part = protected_scores(view, self.policy, seen, prompt_len if pinned is None else pinned)
        except Exception as err:  # noqa: BLE001: raised below, after the collective
            error = err
        scores = combine(part)
        if error is not None:
            raise error
        if bool(scores.isnan().any()):
            raise RuntimeError("kvsieve: another tensor-parallel worker failed to score this batch")
        return view, scores

    def compress(self, scalings: list[float], rings: Rings | None, stack_bytes: int = 0,
                 combine: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 before_scoring: Callable[[list[str]], None] | None = None) -> None:
        """Every layer's keep-set, then every layer's kept slots written into the requests' first
        slots, read from the blocks as they are moved (nothing is written when scoring fails; only
        every layer's kept slots are held meanwhile), then the states updated.  A cross-layer
        scorer (``Needs.cross_layer``, TriAttention's ``per_head``) has every layer read first, and
        every layer keeps the tokens of the mean of their scores (``schedule.cross_layer_scores``)."""
        policy, needs = self.policy, self.policy.scorer.needs
        # a scorer with its own count rule (LagKV) has no budget: keep_set checks its select keeps c.keep
        budget = policy.budget if needs.uses_budget else self.keep
        req_ids = [c.req_id for c in self.cs]
        if before_scoring is not None and needs.cross_layer:
            before_scoring(req_ids)
        views = [self.read(range(layer, layer + 1), scalings[layer], rings) for layer in range(len(self.caches))] \
            if needs.cross_layer else None
        scores = None if views is None else cross_layer_scores(
            views, policy, self.seen, self.prompt_len if self.pinned is None else self.pinned)
        R, H, S = self.pos.shape[1:]
        K, in_place = self.keep, needs.slot_order_free
        chosen, new_pos, new_fields = [], [], {name: [] for name in self.fields}
        for layers in self.stacks(scalings, rings, stack_bytes):  # every layer scored before any is written
            n = len(layers)
            rows = [None if t is None else t.repeat(n) for t in (self.seen, self.prompt_len, self.pinned)]
            if before_scoring is not None and views is None:
                before_scoring(req_ids * n)  # the stack's rows, layer-major
            if views is None:
                view, scores = self.scored(layers, scalings[layers.start], rings, rows, combine)
            else:
                view = views[layers.start]
            kept = keep_set(view, policy, budget, *rows, scores)  # [n * R, H, keep]
            if kept.shape[-1] != K:
                raise RuntimeError(f"kvsieve: the schedule keeps {kept.shape[-1]} tokens, the scheduler planned {K}")
            pos = self.pos[layers.start:layers.stop].view(n * R, H, S)
            # a scorer may have replaced a field in the view's dict (AMS's credit)
            slot_fields = [pos] + [view.meta[name] for name in self.fields]
            if in_place:  # only the kept tokens at or beyond K move, into the evicted slots below K
                row, head, dst, src = hole_moves(kept, S)
                per_layer = torch.bincount(torch.div(row, R, rounding_mode="floor"), minlength=n).tolist()
                chosen += zip(*(t.split(per_layer) for t in (row % R, head, dst, src)))  # [P] each, per layer
                after = [moved_slots(t, row, head, dst, src, K) for t in slot_fields]  # [n * R, H, K] each
            else:  # every kept token into the first K slots, in slot order
                chosen += ((t,) for t in kept.view(n, R, H, K).unbind(0))  # [R, H, K] each, per layer
                after = [t.gather(-1, kept) for t in slot_fields]
            new_pos += after[0].view(n, R, H, K).unbind(0)
            for name, t in zip(self.fields, after[1:]):
                new_fields[name] += t.view(n, R, H, K).unbind(0)
        try:
            for cache, part in zip(self.caches, chosen):
                (move_slots if in_place else compact_rows)(self.layout, cache, self.table, *part)
        except Exception as err:
            raise PartlyWritten(f"{type(err).__name__}: {err}") from err
        pos = torch.stack(new_pos, dim=1)  # [R, L, H, keep]
        fields = {name: torch.stack(t, dim=1) for name, t in new_fields.items()}
        for r, (state, c) in enumerate(zip(self.states, self.cs)):
            state.pos = pos[r]
            state.fields = {name: t[r] for name, t in fields.items()}
            state.next_pos = c.logical_len


def layer_bytes(policy, layout: Layout, caches: list[torch.Tensor], requests: list[tuple[RequestState, Compaction]],
                rings: Rings | None) -> int:
    """Bytes of the largest tensor scoring one layer of ``requests`` together takes: their keys
    [R, H_kv, S, D] (as their values), attention rows [R, H_q, T, S] for T queries (the most any
    of them replays, or its window), their window's queries [R, H_q, T, D] for a scorer that does
    not attend them (``Needs.attends_window``), or a key similarity [R, H_kv, S, S]
    (``Needs.compares_keys``); S the longest KV length."""
    needs = policy.scorer.needs
    R, H, S = len(requests), caches[0].shape[1], max(c.kv_len for _, c in requests)
    queries = 1
    if needs.observes and not needs.observes_last_only:
        queries = max(c.logical_len - state.next_pos for state, c in requests)
    elif needs.query_window and rings is not None:
        queries = min(needs.query_window, rings.held(requests[0][1].req_id))
    heads_q = rings.heads() if rings is not None else H
    head_dim = layout.key_value(caches[0])[0].shape[-1]
    per_query = S if needs.attends_window or not needs.query_window else head_dim // QUERIES_READ_SHARE
    return R * 4 * max(H * S * head_dim, heads_q * max(queries, 1) * per_query, H * S * S if needs.compares_keys else 0)


def split_rows(group_bytes: int, group: list, stack_bytes: int) -> list[list]:
    """``group``'s requests in as few batches of near-equal size as keep one layer's largest
    scoring tensor (``group_bytes`` for the whole group: ``layer_bytes``, the same for each
    request) under ``stack_bytes`` (0: no bound), a request alone where even one takes more.  A
    batch keeps what each of its requests keeps alone (``_Batch``), so the split changes only the
    size of the tensors: large ones are fresh pages each time, smaller ones are reused
    (``STACK_BYTES``)."""
    most = len(group) if stack_bytes <= 0 else max(1, stack_bytes * len(group) // max(group_bytes, 1))
    parts = -(-len(group) // most)
    size = -(-len(group) // parts)
    return [group[i:i + size] for i in range(0, len(group), size)]


def heads_combiner(mode: str,
                   all_gather: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a tensor-parallel worker combines an aligned scorer's scores (``Needs.aligned_heads``:
    [B, H_kv, S], the same in each of its kv heads) with the other workers', every worker holding
    an equal share of the layer's kv heads: the ``mode`` (``Needs.heads_combined_by``, "mean" or
    "max") over the workers' parts, per slot, for every head.  ``all_gather(t)``: the workers' t
    [B, 1, S] side by side, [B, W, S] in rank order (vLLM's ``tensor_model_parallel_all_gather``),
    so every worker reduces the same numbers in the same order and keeps the same tokens.  The
    mean of the workers' means is the mean over the layer's kv heads (equal shares), as one
    worker's TOVA takes it; protected (+inf) and dead (-inf) slots are the same on every worker."""
    reduce = {"mean": lambda t: t.mean(dim=1, keepdim=True), "max": lambda t: t.amax(dim=1, keepdim=True)}[mode]

    def combine(scores: torch.Tensor) -> torch.Tensor:
        return reduce(all_gather(scores[:, :1].contiguous())).expand_as(scores)

    return combine


def hole_moves(kept: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot moves that leave each row's kept slots ``kept`` [N, H, K] (of ``length``) in its
    first K slots, none of those already there moved, as kvsieve's in-place eviction leaves them
    (``cache.SieveLayer.evict``): the i-th lowest evicted slot below K gets the i-th lowest kept
    slot at or beyond K.  (row, head, dst, src), [P] each, ordered by row, then head."""
    N, H, K = kept.shape
    mask = torch.zeros(N, H, length, dtype=torch.bool).scatter_(-1, kept, True)
    row, head, dst = (~mask[..., :K]).nonzero(as_tuple=True)
    src_row, src_head, src = mask[..., K:].nonzero(as_tuple=True)
    if not (torch.equal(row, src_row) and torch.equal(head, src_head)):
        raise RuntimeError("kvsieve: a keep-set has not as many slots to fill as tokens to move")
    return row, head, dst, src + K


def moved_slots(t: torch.Tensor, row: torch.Tensor, head: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                keep: int) -> torch.Tensor:
    """Per-slot values t [N, H, S] after ``hole_moves``: [N, H, keep]."""
    out = t[..., :keep].clone()
    out[row, head, dst] = t[row, head, src]
    return out


def pad(t: torch.Tensor, length: int, value: float) -> torch.Tensor:
    """``t`` [..., n] padded with ``value`` to [..., length]."""
    return torch.nn.functional.pad(t, (0, length - t.shape[-1]), value=value)
