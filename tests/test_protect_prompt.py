"""``Policy.protect_prompt`` (issue 28 item 6) and the report's budget-bound flag (item 7).

The defining property, in the words of the papers that keep the prompt (R-KV as AMS App. B.2
describes it): every prompt token survives every compression, and the budget bounds the
generated tokens only.  Without it prompt and output compete for one budget.
"""

import pytest
import torch

from kvsieve import GenerateConfig, generate, make_policy
from kvsieve.cache import DEAD_POS, SieveCache
from kvsieve.methods import SCORERS, WRAPPERS, describe_methods
from kvsieve.schedule import Schedule, drop_dead_layer, scorer_fields

SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")


# ---------------------------------------------------------------------------- defaults
def test_paper_defaults_and_where_they_show():
    defaults = {name: make_policy(name, budget=64, **kw).protect_prompt for name, kw in {
        "lazy": {"window": 8}, "ams:tova": {}, "skipkv": {}, "caote:tova": {}, "rkv": {}, "tova": {},
    }.items()}
    # rkv: the official code compresses the prompt at prefill (issue 51); protecting it is the named option
    assert defaults == {"lazy": False, "ams:tova": False, "skipkv": False, "caote:tova": False, "rkv": False,
                        "tova": False}
    assert make_policy("lagkv", budget=512).protect_prompt is False
    # a wrapper's paper decides, whatever its base's default
    assert make_policy("caote:rkv", budget=64).protect_prompt is False
    assert make_policy("ams:rkv", budget=64).protect_prompt is False
    assert make_policy("tova", budget=64, protect_prompt=True).settings()["protect_prompt"] is True
    assert make_policy("rkv", budget=64).settings()["protect_prompt"] is False
    assert make_policy("rkv", budget=64, protect_prompt=True).settings()["protect_prompt"] is True
    rows = {r["name"]: r["params"] for r in describe_methods()}
    assert rows["rkv"]["protect_prompt"] is False and rows["lazy"]["protect_prompt"] is False
    assert rows["caote:<base>"]["protect_prompt"] is False and rows["ams:<base>"]["protect_prompt"] is False
    assert all(isinstance(cls.defaults.protect_prompt, bool) for cls in SCORERS.values())
    assert all("protect_prompt" in cls.schedule for cls in WRAPPERS.values())


def test_a_method_without_a_budget_refuses_it():
    with pytest.raises(ValueError, match="protect_prompt"):
        make_policy("lagkv", budget=512, protect_prompt=True)
    with pytest.raises(ValueError, match="true or false"):
        make_policy("tova", budget=64, protect_prompt="yes")


def test_cli_flag_builds_the_policy():
    from kvsieve.cli import _policy

    assert _policy("tova", 64, "uniform", None, None, None, {}, True).protect_prompt is True
    assert _policy("rkv", 64, "uniform", None, None, None, {}, True).protect_prompt is True
    assert _policy("rkv", 64, "uniform", None, None, None, {"protect_prompt": True}).protect_prompt is True
    assert _policy("full", None, "uniform", None, None, None, {}, True).scorer is None


# ---------------------------------------------------------------------------- the engine, on tiny tensors
def _prefilled(policy, prompts, D=4, H=2):
    """A one-layer cache after a left-padded prefill of prompts of lengths ``prompts`` (one per
    row).  Each row draws its K/V from its own generator (seeded by its prompt length), so a row
    holds the same data alone and in any batch.  Returns the cache and the generators."""
    gens = [torch.Generator().manual_seed(1000 + n) for n in prompts]
    B, P = len(prompts), max(prompts)
    cache = SieveCache(1, **scorer_fields(policy.scorer))
    pos = torch.full((B, P), DEAD_POS, dtype=torch.long)
    keys, values = torch.zeros(B, H, P, D), torch.zeros(B, H, P, D)
    for r, n in enumerate(prompts):
        pos[r, P - n:] = torch.arange(n)
        keys[r, :, P - n:] = torch.randn(H, n, D, generator=gens[r])
        values[r, :, P - n:] = torch.randn(H, n, D, generator=gens[r])
    cache.begin_step(pos)
    cache.update(keys, values, 0)
    cache.seen_tokens = (pos != DEAD_POS).sum(dim=1)
    for layer in cache.layers:
        drop_dead_layer(layer, headroom=policy.interval)
    if policy.protect_prompt:
        cache.set_prompt(cache.seen_tokens)
    return cache, gens


def _decode(cache, policy, budget, steps, gens, check):
    """Append one token per row per step, compress on the policy's schedule, ``check`` after each."""
    B, H, _, D = cache.layers[0].keys.shape
    for step in range(1, steps + 1):
        cache.begin_step(cache.seen_tokens[:, None].clone())
        cache.update(torch.stack([torch.randn(H, 1, D, generator=g) for g in gens]),
                     torch.stack([torch.randn(H, 1, D, generator=g) for g in gens]), 0)
        cache.seen_tokens += 1
        if step % policy.interval == 0:
            Schedule(policy, cache, 1 << 20, budgets=[budget]).compress()
        check(cache, step)


@pytest.mark.parametrize("method,allocator,interval", [
    ("knorm", "uniform", 1),  # every step: in-place eviction after the first compaction
    ("knorm", "uniform", 3),  # gather path
    ("keydiff", "adakv", 2),  # ragged heads: the allocator splits the budget over generated tokens
    ("random", "pyramid", 2),
])
def test_every_prompt_token_survives_and_generated_tokens_stay_within_the_budget(method, allocator, interval):
    budget, prompts = 5, [3, 11, 7]
    policy = make_policy(method, budget=budget, allocator=allocator, recent=1, interval=interval, protect_prompt=True)
    cache, gens = _prefilled(policy, prompts)
    H = cache.layers[0].keys.shape[1]

    def check(cache, step):
        layer = cache.layers[0]
        pos, live = layer.meta["pos"], layer.live()
        assert (live.sum(-1) == layer.lengths).all()
        for r, n in enumerate(prompts):
            for h in range(H):
                kept = set(pos[r, h][live[r, h]].tolist())
                assert set(range(n)) <= kept, f"row {r} head {h} lost a prompt token at step {step}"
                generated = len(kept) - n
                cap = budget * (H if allocator == "adakv" else 1)
                assert generated <= cap + (step % interval)
            if allocator == "adakv":  # heads share H * budget generated slots per row
                assert (live[r] & (pos[r] >= n)).sum() <= H * budget + H * (step % interval)

    _decode(cache, policy, budget, 3 * budget, gens, check)
    assert cache.layers[0].max_len <= budget + max(prompts) + interval


def test_without_protection_prompt_and_output_share_the_budget():
    budget, prompts = 5, [3, 11, 7]
    policy = make_policy("knorm", budget=budget, recent=1, interval=2, protect_prompt=False)
    cache, gens = _prefilled(policy, prompts)
    Schedule(policy, cache, 1 << 20, budgets=[budget]).compress()  # the prompt's compression (compress_prefill)

    def check(cache, step):
        if step % policy.interval == 0:
            assert (cache.layers[0].lengths <= budget).all()
        assert (cache.layers[0].lengths <= budget + policy.interval).all()

    _decode(cache, policy, budget, 12, gens, check)


@pytest.mark.parametrize("interval", [1, 3])
def test_a_row_keeps_what_it_keeps_alone(interval):
    """Per-row budgets: a row's kept positions do not depend on the rows beside it (here a row
    with a longer prompt, whose bound is larger)."""
    budget = 4
    policy = make_policy("knorm", budget=budget, recent=1, interval=interval, protect_prompt=True)

    def kept(prompts, row):
        cache, gens = _prefilled(policy, prompts)
        _decode(cache, policy, budget, 9, gens, lambda *a: None)  # ends on a compression
        layer = cache.layers[0]
        return [sorted(p for p in layer.meta["pos"][row, h].tolist() if p != DEAD_POS) for h in range(2)]

    alone = kept([6], 0)
    assert all(len(h) == 6 + budget for h in alone)
    assert kept([6, 10], 0) == alone == kept([10, 6], 1)


# ---------------------------------------------------------------------------- the engine, end to end
def _run(smollm, prompts, policy, n=12, **kw):
    model, tok = smollm
    return generate(model, tok, prompts, policy, GenerateConfig(max_new_tokens=n, **kw))


def test_budget_above_the_output_reproduces_full_even_below_the_prompt(smollm):
    """With the prompt protected only generated tokens count: a budget of at least the new tokens
    evicts nothing, however long the prompt (LONG is ~77 tokens, the budget 16)."""
    full = _run(smollm, [SHORT, LONG], None)
    for name in ("tova", "rkv"):
        ours = _run(smollm, [SHORT, LONG], make_policy(name, budget=16, protect_prompt=True))
        assert ours.token_ids == full.token_ids, name
        assert all(s.compression_events == 0 for s in ours.stats), name


@pytest.mark.parametrize("name,settings", [("tova", {}), ("ams:tova", {"recent": 2, "interval": 3})])
def test_protected_rows_stay_within_prompt_plus_budget_and_match_alone(smollm, monkeypatch, name, settings):
    import kvsieve.session as session_module

    budget = 8
    policy = make_policy(name, budget=budget, protect_prompt=True, **settings)
    checks = []
    original = session_module.DecodeSession.step

    def checked(session, token, compress=True):
        did = original(session, token, compress)
        cache = session.cache
        for layer, b in zip(cache.layers, session.schedule.budgets):
            pos, live = layer.meta["pos"], layer.live()
            prompt = pos < cache.prompt_len[:, None, None]
            assert ((prompt & live).sum(-1) == cache.prompt_len[:, None]).all()  # no prompt token lost
            generated = (live & ~prompt).sum(-1)
            assert (generated <= b + (session.steps % policy.interval)).all()
        checks.append(True)
        return did

    monkeypatch.setattr(session_module.DecodeSession, "step", checked)
    pair = _run(smollm, [LONG, SHORT], policy, n=16, ignore_eos=True)
    monkeypatch.setattr(session_module.DecodeSession, "step", original)
    alone = _run(smollm, [SHORT], policy, n=16, ignore_eos=True)
    assert checks and all(s.compression_events > 0 for s in pair.stats)
    assert pair.token_ids[1] == alone.token_ids[0]
    heads = smollm[0].config.num_key_value_heads
    for stat in pair.stats:  # peak per head: prompt + budget + interval at most
        assert max(stat.peak_kv_tokens) <= heads * (stat.prompt_tokens + budget + policy.interval)


@pytest.mark.slow  # Dynamo trace of a fourth policy (20 s): the default suite traces tova and snapkv already
def test_compiled_step_with_a_protected_prompt_equals_eager(smollm):
    from kvsieve.session import compile_backend

    policy = make_policy("tova", budget=8, protect_prompt=True)
    eager = _run(smollm, [SHORT, LONG], policy, n=16, ignore_eos=True)
    with compile_backend("eager"):
        compiled = _run(smollm, [SHORT, LONG], policy, n=16, ignore_eos=True, compile=True)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats[0].compiled_steps > 0
    assert [s.peak_kv_tokens for s in compiled.stats] == [s.peak_kv_tokens for s in eager.stats]


# ---------------------------------------------------------------------------- the report (item 7)
def _row(method, budget, peak, kv_heads=3, prompt=40, protect=None, **extra):
    settings = {"method": method} if protect is None else {"method": method, "protect_prompt": protect}
    row = {"id": extra.pop("id", "a"), "method": method, "budget": budget, "settings": settings, "prompt_tokens": prompt,
           "generated_tokens": 100, "peak_kv_tokens": peak, "final_kv_tokens": peak, "compression_events": 1,
           "correct": True, **extra}
    if kv_heads is not None:
        row["kv_heads"] = kv_heads
    return row


def test_report_flags_a_cell_whose_peak_exceeds_one_and_a_half_budgets():
    from kvsieve.eval.report import bound_text, over_bound, summarize, table_rows

    assert over_bound(_row("tova", 32, 3 * 48)) is False  # 48 per head = 1.5 x 32: allowed
    assert over_bound(_row("tova", 32, 3 * 49)) is True
    assert over_bound(_row("rkv", 32, 3 * 100, protect=True)) is False  # bound 32 + 40 prompt
    assert over_bound(_row("rkv", 32, 3 * 109, protect=True)) is True  # > 1.5 x 72 = 108
    assert over_bound(_row("tova", 32, 3 * 49, kv_heads=None)) is None  # old row: never guessed
    assert over_bound(_row("full", None, 3 * 500)) is None

    rows = [_row("full", None, 3 * 140), _row("tova", 32, 3 * 40), _row("tova", 32, 3 * 60, id="b"),
            _row("h2o", 32, 3 * 40), _row("snapkv", 32, 3 * 60, kv_heads=None),
            _row("rkv", 32, 3 * 100, protect=True)]
    summaries = {s.method: s for s in summarize(rows)}
    assert {m: bound_text(s) for m, s in summaries.items()} == {
        "full": "-", "tova": "OVER 1/2", "h2o": "ok", "snapkv": "unknown", "rkv": "ok"}
    columns, cells = table_rows(list(summaries.values()))
    assert {row[0]: row[columns.index("bound")] for row in cells}["tova"] == "OVER 1/2"


def test_kvsieve_methods_says_what_each_budget_holds():
    """Issue 51: `kvsieve methods` shows each method's prompt handling, its window and what its budget counts."""
    rows = {r["name"]: r.get("budget") for r in describe_methods()}
    assert rows["rkv"].startswith("prompt competes, compressed at prefill; the budget holds every token")
    assert "recent window: its observation window" in rows["rkv"]
    assert rows["lazy"].startswith("prompt competes from the first decode compression")
    assert rows["lagkv"].startswith("no budget")
    assert rows["streaming"].endswith("4 sinks")
    assert all(rows[name] for name in SCORERS)
