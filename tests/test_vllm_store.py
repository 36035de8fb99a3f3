"""The vLLM store adapter (``kvsieve.vllm.store``) against kvsieve's own store: on the same keys,
values, positions and queries, compressing one request's paged KV keeps, in every (layer, kv
head), the tokens that ``SieveCache`` keeps when kvsieve's schedule compresses it
(``schedule.compress_layer``), and moves their K/V into the request's first slots.  The reference
is fed as kvsieve's engine feeds it: a prompt of ``PROMPT`` tokens in one pass, then one token per
decode step, each pass recording its queries and (for scorers that observe) handing ``observe``
its attention rows; the adapter sees only the KV and the ring of recorded queries, and rebuilds
the observed state at compaction.  Plain torch, no vLLM: runs in the main environment."""

import dataclasses
import threading
import warnings

import pytest
import torch

from kvsieve.attention import attention_probs, visible
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.schedule import compress_layer, keep_set, scorer_fields
from kvsieve.vllm.paged import CpuLayout, gather, write_
from kvsieve.vllm.plan import Compaction, SieveSettings
from kvsieve.vllm.store import RequestState, compress_request

L, H, HQ, D, BLOCK = 2, 2, 4, 8, 4
S, PROMPT, BUDGET = 40, 30, 24
BLOCKS = [9, 2, 7, 0, 3, 11, 5, 1, 4, 10]  # the request's blocks, out of order: S / BLOCK of them
SCALING = D ** -0.5

CASES = {
    "streaming": {},
    "knorm": {"options": {"skip_layers": 0}},
    "keydiff": {},
    "snapkv": {"options": {"window": 8}},
    "rkv": {"options": {"window": 8}, "interval": 8},
    "expected": {"options": {"rope_theta": 10000.0, "hs_buffer": 16}},
    "ams:expected": {"options": {"hs_buffer": 16, "rope_theta": 10000.0, "mass_window": 8}, "recent": 8},
    "streaming-protected": {"method": "streaming", "protect_prompt": True, "budget": 8},
    "tova": {},
    "h2o": {},
    "lazy": {"options": {"window": 4, "alpha": 0.02}},
    "raas": {"options": {"alpha": 0.02}},
    # the output each error is measured from computed at compaction, not in the attention pass
    "caote:tova": {"options": {"prefill_block": False}},
    "fastcaote:h2o": {"options": {"prefill_block": False}},
}


def _request(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(L, H, S, D, generator=g), torch.randn(L, H, S, D, generator=g)
    queries = torch.randn(L, S, HQ, D, generator=g)  # every query row of the request, in position order
    return keys, values, queries


def _paged(keys, values):
    caches = [torch.zeros(12, H, BLOCK, 2 * D) for _ in range(L)]
    block_ids = torch.tensor(BLOCKS)
    for layer, cache in enumerate(caches):
        write_(CpuLayout(), cache, block_ids, keys[layer], values[layer])
    return caches


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_paged_request_keeps_what_kvsieves_store_keeps(case):
    config = {"method": case, "budget": BUDGET, **CASES[case]}
    settings = SieveSettings.from_config(config)
    policy = settings.policy
    window = settings.query_window()
    keys, values, queries = _request(0)
    prompt = PROMPT
    keep = BUDGET if not policy.protect_prompt else prompt + policy.budget

    # kvsieve's store, fed as kvsieve's engine feeds it, then compressed by kvsieve's schedule
    cache = SieveCache(L, **scorer_fields(policy.scorer))
    seen = torch.tensor([S])
    for start, end in [(0, PROMPT)] + [(p, p + 1) for p in range(PROMPT, S)]:  # the prompt, then decode steps
        qpos = torch.arange(start, end)[None]
        cache.begin_step(qpos)
        for layer_idx in range(L):
            layer = cache.layers[layer_idx]
            layer.update(keys[layer_idx, :, start:end][None], values[layer_idx, :, start:end][None], qpos)
            q = queries[layer_idx, start:end].permute(1, 0, 2)[None]  # [1, H_q, T, D]
            layer.begin_attention(q, qpos, SCALING, None)
            if policy.scorer.needs.observes:
                probs = attention_probs(q, layer.keys, visible(layer.meta["pos"], qpos), SCALING)
                policy.scorer.observe(layer.view(), probs, qpos)
    for layer_idx in range(L):
        layer, prompt_len = cache.layers[layer_idx], torch.tensor([prompt]) if policy.protect_prompt else None
        compress_layer(layer, policy, policy.budget, seen, prompt_len, prompt if policy.protect_prompt else 0)

    # the same request in vLLM's blocks, compressed by the adapter
    caches = _paged(keys, values)
    state = RequestState()
    c = Compaction("r", tuple(BLOCKS), kv_len=S, keep=keep, kept_blocks=len(BLOCKS), logical_len=S, prompt_len=prompt)
    ring = settings.query_window(max_model_len=S)  # what the worker records per request and layer
    compress_request(policy, CpuLayout(), caches, [SCALING] * L, state, c,
                     lambda layer: queries[layer, S - min(ring, S):] if ring else None)

    for layer_idx in range(L):
        ref = cache.layers[layer_idx]
        k, v = gather(CpuLayout(), caches[layer_idx], torch.tensor(BLOCKS), keep)  # the request's first slots
        for h in range(H):
            ours = state.pos[layer_idx, h]  # each slot's position: in position order unless moved in place
            assert torch.equal(k[h], keys[layer_idx, h, ours]) and torch.equal(v[h], values[layer_idx, h, ours])
            theirs = ref.meta["pos"][0, h][ref.meta["pos"][0, h] != DEAD_POS].sort().values
            # ties too: one rule (schedule.ranked)
            assert ours.sort().values.tolist() == theirs.tolist(), (case, layer_idx, h)
            if not policy.scorer.needs.slot_order_free:
                assert ours.tolist() == theirs.tolist()
    assert state.next_pos == S and state.pos.shape == (L, H, keep)


@pytest.mark.parametrize("seed", range(4))
def test_kept_tokens_move_into_evicted_slots_as_kvsieves_in_place_eviction_moves_them(seed):
    """``hole_moves`` leaves the slots as ``SieveLayer.evict`` (kvsieve's engine, evicting in place
    for a scorer blind to slot order) leaves them for the same evicted tokens: each (row, head)'s
    kept tokens below the count stay, the ones beyond it fill the evicted slots in order."""
    from kvsieve.vllm.store import hole_moves, moved_slots

    g = torch.Generator().manual_seed(seed)
    rows, keep = 3, 10
    cache = SieveCache(1)
    qpos = torch.arange(S).expand(rows, S)
    cache.begin_step(qpos)
    layer = cache.layers[0]
    layer.update(torch.randn(rows, H, S, D, generator=g), torch.randn(rows, H, S, D, generator=g), qpos)
    order = torch.rand(rows, H, S, generator=g).argsort(dim=-1)
    kept, dropped = order[..., :keep].sort(dim=-1).values, order[..., keep:]  # [rows, H, keep], the rest
    slots = layer.meta["pos"].clone()  # each slot's position (slot s holds position s)
    row, head, dst, src = hole_moves(kept, S)
    ours = moved_slots(slots, row, head, dst, src, keep)
    layer.evict(dropped, torch.full((rows, H), S - keep), keep)
    assert torch.equal(ours, layer.meta["pos"][..., :keep])
    assert torch.equal(ours.sort(dim=-1).values, kept)  # the kept tokens, each once
    stays = torch.zeros(rows, H, S, dtype=torch.bool).scatter_(-1, kept, True)[..., :keep]
    assert torch.equal(ours[stays], slots[..., :keep][stays])  # a kept token below the count never moves


def test_keep_set_refuses_a_select_that_keeps_uneven_counts():
    """A scorer's own ``select`` that keeps different counts per head cannot share a block table."""
    settings = SieveSettings.from_config({"method": "streaming", "budget": BUDGET})
    policy = settings.policy
    keys, values, _ = _request(1)
    cache = SieveCache(1)
    cache.begin_step(torch.arange(S)[None])
    layer = cache.layers[0]
    layer.update(keys[0][None], values[0][None], torch.arange(S)[None])

    class Uneven(type(policy.scorer)):
        def select(self, layer, scores, budget, seen_tokens):
            keep = torch.zeros_like(scores, dtype=torch.bool)
            keep[:, 0, :BUDGET] = True
            keep[:, 1, :BUDGET - 1] = True
            return keep, BUDGET

    policy.scorer = Uneven()
    with pytest.raises(ValueError, match=r"kept \[\[24, 23\]\] tokens per head, not 24"):
        keep_set(layer.view(), policy, BUDGET, torch.tensor([S]))


def _tri_stats(tmp_path) -> str:
    """A TriAttention statistics file for these shapes (random query means), its path."""
    from kvsieve.methods.triattention import QueryStats

    g = torch.Generator().manual_seed(3)
    q_mean = torch.randn(L, HQ, D // 2, 2, generator=g)
    stats = QueryStats(q_mean=q_mean, q_abs_mean=q_mean.norm(dim=-1) * 1.5,
                       inv_freq=10000.0 ** -(torch.arange(0, D, 2, dtype=torch.float64) / D), attention_scaling=1.0,
                       num_kv_heads=H, model_name="synthetic", fingerprint={}, settings={})
    stats.save(tmp_path / "stats.pt")
    return str(tmp_path / "stats.pt")


@pytest.mark.parametrize("prompt", [10, 30])
def test_a_paged_request_keeps_what_the_cross_layer_schedule_keeps(tmp_path, prompt):
    """TriAttention's defaults (issue 51): each kv head keeps the same tokens in every layer, by the
    mean over layers of each layer's scores (``per_head``), and the prompt is pinned inside the budget
    (its first BUDGET tokens when longer, prompt 30 > 24).  The adapter keeps, in every (layer, kv
    head), the tokens kvsieve's own schedule keeps (``Schedule.compress``) on the same keys."""
    from kvsieve.schedule import Schedule

    settings = SieveSettings.from_config({"method": "triattention", "budget": BUDGET,
                                          "options": {"stats": _tri_stats(tmp_path)}})
    policy = settings.policy
    assert policy.pin_prompt and policy.scorer.needs.cross_layer  # the defaults under test
    keys, values, _ = _request(1)

    cache = SieveCache(L, **scorer_fields(policy.scorer))  # kvsieve's store, compressed by its schedule
    qpos = torch.arange(S)[None]
    cache.begin_step(qpos)
    for layer_idx in range(L):
        cache.layers[layer_idx].update(keys[layer_idx][None], values[layer_idx][None], qpos)
    schedule = Schedule(policy, cache, horizon=S)
    schedule.record_prompt(torch.tensor([prompt]))
    cache.set_seen(torch.tensor([S]))
    assert schedule.compress()

    caches, state = _paged(keys, values), RequestState()
    c = Compaction("r", tuple(BLOCKS), kv_len=S, keep=BUDGET, kept_blocks=len(BLOCKS), logical_len=S, prompt_len=prompt)
    compress_request(policy, CpuLayout(), caches, [SCALING] * L, state, c, lambda layer: None)
    for layer_idx in range(L):
        ref = cache.layers[layer_idx].meta["pos"][0]  # [H, cap]
        for h in range(H):
            theirs = ref[h][ref[h] != DEAD_POS].sort().values.tolist()
            assert state.pos[layer_idx, h].sort().values.tolist() == theirs, (prompt, layer_idx, h)
            assert set(range(min(prompt, BUDGET))) <= set(theirs)  # the pinned prompt stays
    assert torch.equal(state.pos[0], state.pos[1])  # the same tokens in every layer


# LagKV keeps its own count (Eq. 10 of its length, ``Needs.count_rule``): a run long enough to freeze
# several partitions, compacted wherever the scheduler's rule says, against kvsieve's own schedule
LAG_TOTAL, LAG_BLOCKS = 96, [17, 3, 22, 8, 0, 12, 19, 5, 25, 1, 14, 9, 23, 6, 20, 2, 11, 16, 24, 4, 18, 7, 13, 21]
LAG_CASES = {
    "lagkv": {"sinks": 4, "options": {"lag": 8, "ratio": 0.25}},
    "localkv": {"sinks": 4, "options": {"lag": 8, "ratio": 0.25}},
    "lagkv-l2": {"sinks": 4, "options": {"lag": 8, "ratio": 0.25, "skip_layers": 0}},
    "lagkv-every-5": {"method": "lagkv", "sinks": 3, "interval": 5, "options": {"lag": 7, "ratio": 0.3}},
    "lagkv-no-prefill": {"method": "lagkv", "sinks": 4, "interval": 3, "compress_prefill": False,
                         "options": {"lag": 8, "ratio": 0.25}},
    "lagkv-budget": {"method": "lagkv", "budget": 40, "sinks": 4, "options": {"off_grid": True}},
}


@pytest.mark.parametrize("case", sorted(LAG_CASES))
def test_a_paged_request_keeps_what_lagkvs_recursion_keeps_at_every_compaction(case):
    """LagKV fed as kvsieve's engine feeds it (the prompt in one pass, then one token per step, its
    schedule's checks after each: ``Schedule.end_prompt``, ``Schedule.after_step``); beside it the
    same request in vLLM's blocks, compacted before each step where the scheduler's rule
    (``plan.keep_count``) gives a count, by the adapter.  At every compaction the count is the one
    kvsieve's store ends with, and every (layer, kv head) holds the same positions with their K/V."""
    from kvsieve.schedule import Schedule, StepPlan
    from kvsieve.vllm.plan import keep_count

    config = {"method": case, "horizon": LAG_TOTAL, **LAG_CASES[case]}
    settings = SieveSettings.from_config(config)
    policy = settings.policy
    if "budget" in config:  # fitted to the horizon as kvsieve's engine fits a batch of that horizon
        assert policy.scorer.fit_note and policy.scorer.ratio < 1
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(L, H, LAG_TOTAL, D, generator=g), torch.randn(L, H, LAG_TOTAL, D, generator=g)

    cache = SieveCache(L, **scorer_fields(policy.scorer))  # kvsieve's store and schedule
    schedule = Schedule(policy, cache, horizon=LAG_TOTAL)
    caches = [torch.zeros(max(LAG_BLOCKS) + 2, H, BLOCK, 2 * D) for _ in range(L)]  # a pool; the request has LAG_BLOCKS
    blocks, state, kv_len, compactions = torch.tensor(LAG_BLOCKS), RequestState(), 0, 0

    def feed(start: int, end: int) -> None:
        """Tokens start .. end - 1 into both stores (kvsieve's appends; vLLM writes after the KV held)."""
        nonlocal kv_len
        qpos = torch.arange(start, end)[None]
        cache.begin_step(qpos)
        for layer in range(L):
            k, v = keys[layer, :, start:end], values[layer, :, start:end]
            cache.layers[layer].update(k[None], v[None], qpos)
            held_k, held_v = gather(CpuLayout(), caches[layer], blocks, kv_len)
            write_(CpuLayout(), caches[layer], blocks, torch.cat([held_k, k], 1), torch.cat([held_v, v], 1))
        kv_len += end - start

    cache.set_seen(torch.zeros(1, dtype=torch.long))
    feed(0, PROMPT)
    schedule.end_prompt(torch.tensor([PROMPT]), grow_chunk=8)
    for n in range(PROMPT, LAG_TOTAL + 1):  # the scheduler's moments: n tokens seen, all in the KV
        if n > PROMPT:  # the decode step that wrote token n - 1, then kvsieve's check after it
            feed(n - 1, n)
            cache.count_decoded()
            schedule.after_step(StepPlan())
        keep = keep_count(settings, kv_len, decode_steps=n - PROMPT, prompt_len=PROMPT)
        if keep is not None:
            c = Compaction("r", tuple(LAG_BLOCKS), kv_len=kv_len, keep=keep, kept_blocks=len(LAG_BLOCKS),
                           logical_len=n, prompt_len=PROMPT)
            compress_request(policy, CpuLayout(), caches, [SCALING] * L, state, c, lambda layer: None)
            kv_len, compactions = keep, compactions + 1
        ours = state.positions(kv_len, L, H)  # [L, H, kv_len]
        for layer in range(L):
            theirs = cache.layers[layer].meta["pos"][0]  # [H, cap]
            k, v = gather(CpuLayout(), caches[layer], blocks, kv_len)
            for h in range(H):
                assert ours[layer, h].tolist() == theirs[h][theirs[h] != DEAD_POS].tolist(), (case, n, layer, h)
                assert torch.equal(k[h], keys[layer, h, ours[layer, h]]), (case, n, layer, h)
                assert torch.equal(v[h], values[layer, h, ours[layer, h]]), (case, n, layer, h)
    scorer = policy.scorer
    frozen = (LAG_TOTAL - kv_len) // (scorer.lag - scorer.kept)
    assert compactions >= 3 and frozen >= 4, (compactions, frozen)


# Requests compressed in one step together (``compress_requests``: one gather, one scoring, one write
# per layer for all of them) against each compressed alone: (kv length, prompt) per request, each
# with its own K/V, queries and blocks; a second compaction after EXTRA more tokens each.
TOGETHER, EXTRA = [(40, 30), (33, 20), (37, 26)], 6


def _pool_requests(seed: int):
    """Three requests in one pool of blocks: their K/V and queries (EXTRA positions beyond their
    first length), and each one's blocks, disjoint and out of order."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(3 * 12, generator=g).tolist()
    out = []
    for r, (kv_len, _) in enumerate(TOGETHER):
        n = kv_len + EXTRA
        out.append((torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g),
                    torch.randn(L, n, HQ, D, generator=g), order[12 * r:12 * r + 12]))
    return out


def _compress_all(policy, ring: int, requests, together: bool, stack_bytes: int | None = None, combine=None,
                  failed: dict | None = None, before_scoring=None):
    """Both compactions of every request, together or one by one: the pool and the states (the
    requests' kv heads: those of their keys).  combine, before_scoring: ``compress_requests``';
    failed: collects the requests it could not compress."""
    from kvsieve.vllm.store import STACK_BYTES, HeldRings, compress_requests

    heads = requests[0][0].shape[1]
    caches = [torch.zeros(3 * 12, heads, BLOCK, 2 * D) for _ in range(L)]
    states = [RequestState() for _ in requests]
    for (keys, values, _, blocks), (kv_len, _) in zip(requests, TOGETHER):
        for layer in range(L):
            write_(CpuLayout(), caches[layer], torch.tensor(blocks), keys[layer, :, :kv_len], values[layer, :, :kv_len])
    lengths = [kv_len for kv_len, _ in TOGETHER]
    for step in range(2):
        items = []
        for r, ((keys, values, queries, blocks), (first, prompt)) in enumerate(zip(requests, TOGETHER)):
            logical = first + EXTRA * step
            if step:  # EXTRA tokens appended after the kept ones, as vLLM's decode steps write them
                for layer in range(L):
                    held_k, held_v = gather(CpuLayout(), caches[layer], torch.tensor(blocks), lengths[r])
                    write_(CpuLayout(), caches[layer], torch.tensor(blocks),
                           torch.cat([held_k, keys[layer, :, first:logical]], 1),
                           torch.cat([held_v, values[layer, :, first:logical]], 1))
                lengths[r] += EXTRA
            keep = policy.budget + (prompt if policy.protect_prompt else 0)
            items.append((states[r], Compaction(f"r{r}", tuple(blocks), kv_len=lengths[r], keep=keep,
                                                kept_blocks=len(blocks), logical_len=logical, prompt_len=prompt)))
            lengths[r] = keep

        # each request's ring: its last `ring` queries in every layer, head-major [L, H_q, n, D]
        rings = None if not ring else HeldRings({
            c.req_id: requests[r][2][:, c.logical_len - min(ring, c.logical_len):c.logical_len].transpose(1, 2)
            for r, (_, c) in enumerate(items)})
        if together:
            lost = compress_requests(policy, CpuLayout(), caches, [SCALING] * L, items, rings,
                                     STACK_BYTES if stack_bytes is None else stack_bytes, combine=combine,
                                     before_scoring=before_scoring)
            if failed is not None:
                failed.update(lost)
        else:
            for state, c in items:
                compress_request(policy, CpuLayout(), caches, [SCALING] * L, state, c,
                                 lambda layer, c=c: None if rings is None
                                 else rings.queries[c.req_id][layer].transpose(0, 1))
    return caches, states


@pytest.mark.parametrize("case", sorted(CASES) + ["triattention"])
def test_requests_compressed_together_keep_what_each_keeps_alone(case, tmp_path):
    """A step's requests scored as one batch (rows of different lengths, prompts, positions and
    recorded queries; the shorter ones padded with dead slots) keep, in every (layer, kv head), the
    very tokens each keeps when compressed alone, with the same fields, at both compactions; their
    K/V land in each request's own first slots; and the same when each layer is scored alone,
    where a scorer stacks layers (``Needs.stacks_layers``).  TriAttention: its defaults (cross-layer, the
    prompt pinned inside the budget)."""
    config = {"method": case, "budget": BUDGET, **CASES.get(case, {})}
    if case == "triattention":
        config["options"] = {"stats": _tri_stats(tmp_path)}
    settings, requests = SieveSettings.from_config(config), _pool_requests(11)
    ring = settings.query_window(max_model_len=max(n for n, _ in TOGETHER) + EXTRA)
    caches_t, states_t = _compress_all(settings.policy, ring, requests, together=True)
    # a scorer of its own (a stateful one keeps per-layer state between calls)
    caches_a, states_a = _compress_all(SieveSettings.from_config(config).policy, ring, requests, together=False)
    # and together one layer at a time (no stacked layers: ``stack_bytes`` 0)
    caches_l, states_l = _compress_all(SieveSettings.from_config(config).policy, ring, requests, True, 0)
    for r, (keys, values, _, blocks) in enumerate(requests):
        for other in (states_a, states_l):
            assert torch.equal(states_t[r].pos, other[r].pos), (case, r)
            assert states_t[r].fields.keys() == other[r].fields.keys()
            for name in states_t[r].fields:
                torch.testing.assert_close(states_t[r].fields[name], other[r].fields[name], rtol=1e-5, atol=1e-6)
        keep = states_t[r].pos.shape[-1]
        for layer in range(L):
            k, v = gather(CpuLayout(), caches_t[layer], torch.tensor(blocks), keep)
            for h in range(H):
                kept = states_t[r].pos[layer, h]
                assert torch.equal(k[h], keys[layer, h, kept]) and torch.equal(v[h], values[layer, h, kept])


def test_skipkv_scores_stacked_layers_with_each_rows_own_sentences():
    """SkipKV's layers scored as one stack (its table's rows selected once per view row) keep the
    tokens they keep scored one layer at a time, and the sentence penalty takes part: without the
    table the same requests keep other tokens."""
    from kvsieve.methods.skipkv import SentenceTable
    from kvsieve.vllm.sentences import RequestSentences, sentence_reader

    requests = _pool_requests(7)
    kept = {}
    for way, stack_bytes in (("one layer at a time", 0), ("stacked", None), ("no table", None)):
        settings = SieveSettings.from_config({"method": "skipkv", "budget": BUDGET, "options": {"tau": 0.2}})
        feeder = RequestSentences(SentenceTable(torch.tensor([3, 7]), capacity=8))
        g = torch.Generator().manual_seed(11)
        for r, (first, _) in enumerate(TOGETHER):  # every token the two compactions see, with hidden states
            n = first + EXTRA
            feeder.feed([f"r{r}"], [0, n], torch.randint(0, 10, (n,), generator=g), torch.arange(n),
                        torch.randn(n, 6, generator=g))
        if way != "no table":
            sentence_reader(settings.policy.scorer).read_sentences(feeder.table)
        calls = []

        def select(req_ids):
            calls.append(len(req_ids))
            feeder.select(req_ids)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if way == "no table" else "error")
            _, states = _compress_all(settings.policy, settings.query_window(max_model_len=64), requests, True,
                                      stack_bytes, before_scoring=select)
        kept[way] = [state.pos.sort(dim=-1).values for state in states]
        if way == "stacked":
            assert max(calls) > 3  # several layers' rows in one selection
    assert all(torch.equal(a, b) for a, b in zip(kept["stacked"], kept["one layer at a time"]))
    assert not all(torch.equal(a, b) for a, b in zip(kept["stacked"], kept["no table"]))


class _ThreadGather:
    """vLLM's tensor-parallel all-gather between threads standing for workers: each worker's
    [B, 1, S] part, side by side in rank order.  A worker that never comes fails the barrier
    (a deadlock would fail the test, not hang it)."""

    def __init__(self, workers: int):
        self.parts = [None] * workers
        self.barrier = threading.Barrier(workers, timeout=60)

    def of(self, rank: int):
        def all_gather(t):
            self.parts[rank] = t
            self.barrier.wait()
            out = torch.cat(self.parts, dim=1)
            self.barrier.wait()  # every worker has read the parts before any writes its next
            return out
        return all_gather


def _split_run(config: dict, requests, poison: int | None = None):
    """Both compactions of the three requests on two workers, each holding one of the H = 2 kv heads
    (and its query heads), run side by side, their scores combined (``store.heads_combiner``);
    ``poison``: a request whose queries on worker 1 are NaN.  Each worker's states and failures."""
    from kvsieve.vllm.store import heads_combiner

    settings = SieveSettings.from_config(config)
    ring = settings.query_window(max_model_len=max(n for n, _ in TOGETHER) + EXTRA)
    gather, out = _ThreadGather(2), [None, None]

    def worker(rank: int):
        policy = settings.policy
        if hasattr(policy.scorer, "for_heads"):  # TriAttention: the statistics of its heads
            policy = dataclasses.replace(policy, scorer=policy.scorer.for_heads(rank, 2))
        part = []
        for r, (keys, values, queries, blocks) in enumerate(requests):
            q = queries[:, :, rank * HQ // 2:(rank + 1) * HQ // 2].clone()
            if rank == 1 and r == poison:
                q.fill_(float("nan"))
            part.append((keys[:, rank:rank + 1], values[:, rank:rank + 1], q, blocks))
        failed = {}
        combine = heads_combiner(policy.scorer.needs.heads_combined_by, gather.of(rank))
        out[rank] = (_compress_all(policy, ring, part, True, combine=combine, failed=failed)[1], failed)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out), "a worker failed"
    return out


@pytest.mark.parametrize("case", ["tova", "triattention-per-layer"])
def test_workers_holding_a_layers_heads_apart_keep_what_one_worker_keeps(case, tmp_path):
    """Tensor parallelism for a scorer that combines a layer's kv heads (TOVA's heads="layer" mean,
    TriAttention's per_layer max): two workers, each holding one kv head, combine their scores and
    keep, at both compactions, the very tokens one worker holding both heads keeps; scored each
    alone, they would not.  A request whose scoring fails on one worker fails on both, and both
    compress the others: no worker waits in a collective the other never makes."""
    config = {"method": "tova", "budget": BUDGET}
    if case != "tova":
        config = {"method": "triattention", "budget": BUDGET,
                  "options": {"stats": _tri_stats(tmp_path), "pruning": "per_layer"}}
    requests = _pool_requests(7)
    settings = SieveSettings.from_config(config)
    ring = settings.query_window(max_model_len=max(n for n, _ in TOGETHER) + EXTRA)
    _, whole = _compress_all(settings.policy, ring, requests, True)
    split = _split_run(config, requests)
    for rank, (states, failed) in enumerate(split):
        assert not failed
        for r in range(len(requests)):
            assert torch.equal(states[r].pos[:, 0], whole[r].pos[:, rank]), (case, rank, r)
    alone = [_compress_all(SieveSettings.from_config(config).policy if case == "tova" else dataclasses.replace(
        settings.policy, scorer=settings.policy.scorer.for_heads(rank, 2)), ring,
        [(k[:, rank:rank + 1], v[:, rank:rank + 1], q[:, :, rank * HQ // 2:(rank + 1) * HQ // 2], b)
         for k, v, q, b in requests], True)[1] for rank in (0, 1)]
    assert any(not torch.equal(alone[rank][r].pos[:, 0], whole[r].pos[:, rank]) for rank in (0, 1)
               for r in range(len(requests))), "scored alone the workers keep the same tokens: the test shows nothing"
    if case == "tova":  # NaN queries on worker 1: its scores for that request are NaN, the combination too
        poisoned = _split_run(config, requests, poison=1)
        assert poisoned[0][1].keys() == poisoned[1][1].keys() == {"r1"}
        for rank, (states, _) in enumerate(poisoned):
            for r in (0, 2):
                assert torch.equal(states[r].pos[:, 0], whole[r].pos[:, rank]), (rank, r)


def test_requests_of_one_count_are_scored_in_one_call_per_layer_or_for_every_layer(monkeypatch):
    """Requests keeping the same count are scored together: one keep-set per layer for the three,
    or one for every layer where the scorer stacks layers (``Needs.stacks_layers``: a view of
    L * 3 rows).  A replaying scorer (H2O: every query since its last compaction) scores them one
    by one at the first compaction, where each replays its own prompt, and together at the
    second, where each replays its EXTRA decode queries.  Random draws per call, so its layers
    are scored one at a time."""
    import kvsieve.vllm.store as store

    calls = []
    real = store.keep_set
    monkeypatch.setattr(store, "keep_set", lambda layer, *args: calls.append(layer.keys.shape[0]) or real(layer, *args))
    requests = _pool_requests(5)
    for method, stack_bytes, expected in (("tova", 0, [3] * L * 2), ("h2o", 0, [1] * 3 * L + [3] * L),
                                          ("tova", None, [3 * L] * 2), ("h2o", None, [L] * 3 + [3 * L]),
                                          ("random", None, [3] * L * 2)):
        calls.clear()
        settings = SieveSettings.from_config({"method": method, "budget": BUDGET})
        _compress_all(settings.policy, settings.query_window(max_model_len=64), requests, True, stack_bytes)
        assert calls == expected, (method, stack_bytes)


def test_a_batch_whose_one_layer_outgrows_the_bound_is_split_and_keeps_the_same_tokens(monkeypatch):
    """Where one layer's largest scoring tensor for a step's requests takes more than
    ``stack_bytes``, they are compressed in batches of fewer requests (``split_rows``), each
    keeping the tokens the whole batch keeps.  TOVA's gathered keys (more than its newest attention
    rows) take 4 bytes x 2 kv heads x S slots x 8 dimensions a request: 2,560 bytes at the first
    compaction (S = 40), 1,920 at the second (S = 30).  So under 4,000 bytes the three requests are
    compressed one at a time at the first (two take 5,120 bytes), one layer a call, and at the
    second as one (the last batch first, its two layers stacked: 3,840 bytes), then two, one layer
    a call."""
    import kvsieve.vllm.store as store

    calls = []
    real = store.keep_set
    monkeypatch.setattr(store, "keep_set", lambda layer, *args: calls.append(layer.keys.shape[0]) or real(layer, *args))
    requests = _pool_requests(5)
    kept = {}
    for stack_bytes in (0, 4000):
        calls.clear()
        settings = SieveSettings.from_config({"method": "tova", "budget": BUDGET})
        _, states = _compress_all(settings.policy, settings.query_window(max_model_len=64), requests, True, stack_bytes)
        kept[stack_bytes] = [(state.pos, state.fields) for state in states]
        assert calls == ([3] * L * 2 if stack_bytes == 0 else [1] * 3 * L + [2] + [2] * L), stack_bytes
    for (pos_a, fields_a), (pos_b, fields_b) in zip(kept[0], kept[4000]):
        assert torch.equal(pos_a, pos_b)
        assert all(torch.equal(fields_a[name], fields_b[name]) for name in fields_a)


@pytest.mark.parametrize("method", ["h2o", "lazy"])
def test_first_compactions_of_prompts_alike_replay_together_and_keep_what_each_keeps_alone(method, monkeypatch):
    """Requests whose first compaction replays a prompt of the same length up to the same position
    (``replay_shape``) are scored as one batch, three rows in one call per layer at both
    compactions, and keep the very tokens and fields each keeps alone."""
    import sys

    import kvsieve.vllm.store as store

    monkeypatch.setattr(sys.modules[__name__], "TOGETHER", [(40, 30)] * 3)  # three prompts of 30, 40 tokens each
    calls = []
    real = store.keep_set
    monkeypatch.setattr(store, "keep_set", lambda layer, *args: calls.append(layer.keys.shape[0]) or real(layer, *args))
    config = {"method": method, "budget": BUDGET, **CASES.get(method, {})}
    settings, requests = SieveSettings.from_config(config), _pool_requests(13)
    ring = settings.query_window(max_model_len=64)
    _, together = _compress_all(settings.policy, ring, requests, True, 0)  # one layer at a time: a call per layer
    assert calls == [3] * L * 2, calls
    _, alone = _compress_all(SieveSettings.from_config(config).policy, ring, requests, False)
    for a, b in zip(together, alone):
        assert torch.equal(a.pos, b.pos)
        for name in a.fields:
            torch.testing.assert_close(a.fields[name], b.fields[name], rtol=1e-5, atol=1e-6)


def test_split_rows_makes_as_few_near_equal_batches_as_the_bound_allows():
    from kvsieve.vllm.store import split_rows

    assert split_rows(100, list(range(7)), 0) == [list(range(7))]  # 0: no bound
    assert split_rows(100, list(range(7)), 100) == [list(range(7))]
    assert split_rows(100, list(range(7)), 30) == [[0, 1], [2, 3], [4, 5], [6]]  # 4 parts of at most 25 bytes
    assert split_rows(100, [0, 1], 10) == [[0], [1]]  # a request alone where even one takes more


@pytest.mark.parametrize("config", [
    {"method": "streaming", "protect_prompt": True, "budget": 8},
    {"method": "tova", "protect_prompt": True, "budget": 8},
    {"method": "keydiff", "pin_prompt": True, "budget": 34},
])
def test_a_compaction_never_moves_the_prompt_prefix_prefix_caching_shares(config):
    """The blocks of ``prefix.shared_tokens`` (the prompt kept outside the budget, or pinned inside
    it) hold the same bytes after a compaction, which moves the tokens after them: what lets vLLM
    share them between requests (issue 59 item 2)."""
    from kvsieve.vllm.prefix import shared_tokens

    settings = SieveSettings.from_config(config)
    policy = settings.policy
    keys, values, queries = _request(1)
    caches = _paged(keys, values)
    before = [cache.clone() for cache in caches]
    shared = shared_tokens(policy, PROMPT, BLOCK)
    keep = PROMPT + policy.budget if policy.protect_prompt else policy.budget
    assert shared == (PROMPT if policy.protect_prompt else min(PROMPT, policy.budget)) // BLOCK * BLOCK > 0
    c = Compaction("r", tuple(BLOCKS), kv_len=S, keep=keep, kept_blocks=len(BLOCKS), logical_len=S, prompt_len=PROMPT)
    compress_request(policy, CpuLayout(), caches, [SCALING] * L, RequestState(), c, lambda layer: queries[layer])
    for cache, old in zip(caches, before):
        assert all(torch.equal(cache[b], old[b]) for b in BLOCKS[:shared // BLOCK])
    assert any(not torch.equal(cache[b], old[b]) for cache, old in zip(caches, before)
               for b in BLOCKS[shared // BLOCK:])  # the compaction did move tokens after the prefix


def test_query_rings_hand_back_each_requests_last_queries():
    """``QueryRecorder``: steps of several requests' query rows (prefill chunks longer than the ring,
    single decode rows, a request finishing and its ring reused), then ``rows`` of several
    requests at once equals each request's last n queries kept here in plain lists."""
    from kvsieve.vllm.rings import QueryRecorder

    window, heads, dim = 4, 2, 3
    recorder = QueryRecorder(["a", "b"], max_slots=3, window=window, num_heads=heads, head_size=dim,
                             dtype=torch.float32)
    seen: dict[str, list[torch.Tensor]] = {}  # request -> every query row recorded, layer "b"
    g = torch.Generator().manual_seed(0)
    steps = [{"x": 6, "y": 2}, {"x": 1, "y": 1}, {"x": 1, "z": 3}, {"y": 1, "z": 1}, {"z": 1, "w": 5}]
    for step in steps:
        if "w" in step:  # x finished: its ring is free for w
            recorder.forget("x")
            seen.pop("x")
        ids, counts = list(step), list(step.values())
        ends = torch.tensor(counts).cumsum(0).tolist()
        recorder.plan(ids, [e - n for e, n in zip(ends, counts)], ends)
        rows = torch.randn(ends[-1], heads, dim, generator=g)
        recorder.record("a", torch.zeros_like(rows))
        recorder.record("b", rows)
        for req, start, end in zip(ids, [e - n for e, n in zip(ends, counts)], ends):
            seen.setdefault(req, []).extend(rows[start:end])
    for req in seen:
        assert recorder.held(req) == min(len(seen[req]), window)
    ids = ["y", "z", "w"]
    for n in (1, 2, 3):
        got = recorder.rows(range(1, 2), ids, n)  # [R, H, n, D]
        assert torch.equal(got, torch.stack([torch.stack(seen[r][-n:], dim=1) for r in ids]))
        both = recorder.rows(range(0, 2), ids, n)  # [2 * R, H, n, D], layer-major
        assert not both[:len(ids)].any() and torch.equal(both[len(ids):], got)  # layer "a" got zeros
