"""End-to-end behaviour of the decode loop on the bundled SmolLM2-135M (30 layers, 9 q / 3 kv heads)."""

import dataclasses
import pytest
import torch

import kvsieve
import importlib

gen_module = importlib.import_module("kvsieve.generate")
session_module = importlib.import_module("kvsieve.session")
from kvsieve import GenerateConfig, generate, make_policy
from kvsieve.methods import method_names
from kvsieve.policy import SCORERS
from kvsieve.schedule import layer_budgets

SHORT = "What is 7 times 8?"
LONG = ("Here is a short story. A fox lived near a river and every morning it walked to the water "
        "to drink. One day it met a heron standing on one leg. Tell me, in two sentences, what the fox said.")
BIG = 4096  # larger than any sequence below: nothing may be evicted


def tokens(model_tok, prompts, policy, n=24, **kw):
    model, tok = model_tok
    return generate(model, tok, prompts, policy, GenerateConfig(max_new_tokens=n, **kw))


def test_full_matches_transformers_greedy(smollm):
    model, tok = smollm
    for prompt in (SHORT, LONG):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
        ours = tokens(smollm, [prompt], None, n=20).token_ids[0]
        n = min(len(ref), len(ours))
        assert ours[:n] == ref[:n] and n > 0


# triattention needs statistics of the model: tests/methods/test_triattention.py calibrates them and runs this test
@pytest.mark.parametrize("method", [m for m in method_names() if m not in ("full", "triattention")
                                    and SCORERS[m].needs.uses_budget])
def test_budget_at_least_length_reproduces_full(smollm, full_greedy, method):
    full = full_greedy([SHORT, LONG], 24)
    ours = tokens(smollm, [SHORT, LONG], make_policy(method, budget=BIG))
    assert ours.token_ids == full.token_ids
    assert all(s.compression_events == 0 for s in ours.stats)


@pytest.mark.parametrize("method", ["tova", pytest.param("ams:tova", marks=pytest.mark.slow)])
def test_observing_only_before_a_compression_changes_nothing_for_a_last_query_scorer(smollm, monkeypatch, method):
    """TOVA's state is the newest query's attention, read only by the compression after every
    interval-th step, so skipping the observation in between gives the same tokens and the same
    compressions as observing every step."""
    from kvsieve.methods.tova import TOVA

    policy = make_policy(method, budget=40, interval=8, **({"recent": 8} if method == "ams:tova" else {}))
    calls = []
    real_observe = TOVA.observe
    monkeypatch.setattr(TOVA, "observe", lambda self, *a: calls.append(1) or real_observe(self, *a))
    skipping = tokens(smollm, [SHORT, LONG], policy, n=40)
    skipped_calls = len(calls)
    monkeypatch.setattr(TOVA, "needs", dataclasses.replace(TOVA.needs, observes_last_only=False))
    calls.clear()
    every = tokens(smollm, [SHORT, LONG], make_policy(method, budget=40, interval=8,
                                                      **({"recent": 8} if method == "ams:tova" else {})), n=40)
    assert skipping.token_ids == every.token_ids
    assert [s.compression_events for s in skipping.stats] == [s.compression_events for s in every.stats]
    assert any(s.compression_events > 0 for s in every.stats)
    assert skipped_calls < len(calls)


@pytest.mark.parametrize("allocator", ["pyramid", "adakv"])
def test_allocators_with_large_budget_reproduce_full(smollm, full_greedy, allocator):
    full = full_greedy([SHORT, LONG], 24)
    ours = tokens(smollm, [SHORT, LONG], make_policy("tova", budget=BIG, allocator=allocator, heads="group"))
    assert ours.token_ids == full.token_ids


def test_tova_layer_average_refuses_a_ragged_allocator():
    with pytest.raises(ValueError, match="heads to keep the same tokens"):
        make_policy("tova", budget=64, allocator="adakv")


@pytest.mark.parametrize("method,allocator,settings", [
    ("tova", "uniform", {}),
    ("h2o", "uniform", {}),
    ("snapkv", "uniform", {"window": 8}),
    ("rkv", "uniform", {"interval": 8, "window": 4, "protect_prompt": False}),  # the total bound
    ("knorm", "pyramid", {"recent": 4}),
    ("keydiff", "adakv", {"recent": 4}),
    ("streaming", "uniform", {}),
])
def test_lengths_within_budget_after_every_compression(smollm, monkeypatch, method, allocator, settings):
    """After every decode step and its compression (in-step eviction for every-step policies,
    after the pass for interval ones) each layer holds at most its budget per head."""
    budget = 24
    policy = make_policy(method, budget=budget, allocator=allocator, **settings)
    budgets = layer_budgets(policy, smollm[0].config.num_hidden_layers)
    checks = []
    original = session_module.DecodeSession.step

    def checked(session, token, compress=True):
        did = original(session, token, compress)
        if session.steps % policy.interval:  # between compressions a layer may hold budget + interval
            return did
        cache = session.cache
        for layer, b in zip(cache.layers, session.schedule.budgets):
            if b is None:  # a layer the method never compresses (knorm's first two) keeps every token
                assert (layer.lengths == cache.seen_tokens[:, None]).all()
            elif allocator == "adakv":  # heads share H_kv * budget slots per row
                assert (layer.lengths.sum(dim=1) <= b * layer.lengths.shape[1]).all()
            else:
                assert (layer.lengths <= b).all()
            assert (layer.live().sum(-1) == layer.lengths).all()  # live slots are exactly the first `length`
        checks.append(True)
        return did

    monkeypatch.setattr(session_module.DecodeSession, "step", checked)
    result = tokens(smollm, [SHORT, LONG], policy, n=32)
    assert checks, "the test must actually check"
    assert budgets == layer_budgets(policy, 30)
    assert all(s.compression_events > 0 for s in result.stats)


def test_streaming_cache_equals_dense_forward_over_kept_tokens(smollm, monkeypatch):
    """Decoding with a StreamingLLM cache gives the same logits as a plain forward pass over the
    whole sequence in which each generated token sees exactly what the cache kept: the sinks and
    the last R tokens, at their original positions."""
    model, tok = smollm
    sinks, budget, n_new = 4, 20, 12
    window = budget - sinks
    logits_seen = []
    real_sample = gen_module.sample
    monkeypatch.setattr(gen_module, "sample", lambda lg, cfg, g: (logits_seen.append(lg.clone()), real_sample(lg, cfg, g))[1])
    result = generate(model, tok, [LONG], make_policy("streaming", budget=budget),
                      GenerateConfig(max_new_tokens=n_new, prefill_chunk=4096))
    prompt = tok.apply_chat_template([{"role": "user", "content": LONG}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    P = len(prompt)
    assert P > budget
    seq = torch.tensor([prompt + result.token_ids[0][:-1]])
    T = seq.shape[1]
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    allowed = k <= q
    generated_rows = q >= P
    allowed &= ~generated_rows | (k < sinks) | (k >= q - window)
    mask = torch.zeros(1, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            dense = model(input_ids=seq, attention_mask=mask, position_ids=torch.arange(T)[None]).logits[0]
    finally:
        model.set_attn_implementation("sdpa")
    for i, ours in enumerate(logits_seen):
        torch.testing.assert_close(ours[0], dense[P - 1 + i], atol=2e-4, rtol=1e-4)
    assert len(logits_seen) == len(result.token_ids[0])



@pytest.mark.parametrize("method", ["full", "tova", *(pytest.param(m, marks=pytest.mark.slow)  # tova: the in-place path
                                                      for m in ("lazy", "h2o", "snapkv"))])
def test_static_shapes_fix_every_address_while_decoding_and_change_no_token(smollm, monkeypatch, method):
    """GenerateConfig(static_shapes=True): each decode step sees the same storage (addresses and
    shapes of K/V, lengths, metadata and query window) -- what a compiled step needs -- and
    greedy tokens equal the default path's."""
    settings = {"lazy": {"window": 8}, "snapkv": {"window": 8, "interval": 4}}.get(method, {})
    policy = make_policy(method, budget=None if method == "full" else 24, **settings)
    seen = []
    original = session_module.model_pass

    def spy(model, cache, tokens, query_pos, *args):
        if query_pos is None:  # a decode step
            seen.append(tuple(layer.storage() for layer in cache.layers))
        return original(model, cache, tokens, query_pos, *args)

    monkeypatch.setattr(session_module, "model_pass", spy)
    static = tokens(smollm, [SHORT, LONG], policy, n=32, ignore_eos=True, static_shapes=True)
    # lazy keeps the prompt (longer than the budget) whole until its first compression at step W,
    # whose compaction to budget + W reallocates once; every other storage is fixed from step 1
    assert len(seen) == 31 and len(set(seen)) == (2 if method == "lazy" else 1)
    seen.clear()
    default = tokens(smollm, [SHORT, LONG], policy, n=32, ignore_eos=True)
    assert static.token_ids == default.token_ids


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming"])
def test_order_free_bounded_cache_keeps_one_fixed_allocation_while_decoding(smollm, monkeypatch, method):
    """After prefill, an every-step policy evicts in place: no reallocation, no growth, so every
    decode step has the same shapes (what a compiled step needs)."""
    from kvsieve.cache import SieveLayer

    storage, compactions = set(), []
    original_evict, original_compact = SieveLayer.evict, SieveLayer.compact

    def evict(self, *args, **kwargs):
        original_evict(self, *args, **kwargs)
        storage.add((self.layer_idx, self.keys.data_ptr(), self.values.data_ptr(), tuple(self.keys.shape)))

    monkeypatch.setattr(SieveLayer, "evict", evict)
    monkeypatch.setattr(SieveLayer, "compact", lambda self, *a, **k: (compactions.append(1), original_compact(self, *a, **k)))
    result = tokens(smollm, [SHORT, LONG], make_policy(method, budget=24), n=40, ignore_eos=True)
    layers = smollm[0].config.num_hidden_layers
    assert len(compactions) <= 2 * layers  # drop_dead + the prompt's compression only
    assert len(storage) == layers  # one allocation per layer for the whole decode (rows never finish early)
    assert all(shape[2] == 24 + 1 for _, _, _, shape in storage)  # budget + interval
    assert all(s.compression_events >= 40 - 1 for s in result.stats)


@pytest.mark.parametrize("method", ["full", "tova"])
def test_padding_rows_do_not_change_other_rows(smollm, method):
    policy = None if method == "full" else make_policy(method, budget=24)
    alone = tokens(smollm, [SHORT], policy).token_ids[0]
    first = tokens(smollm, [SHORT, LONG], policy).token_ids[0]
    second = tokens(smollm, [LONG, SHORT], policy).token_ids[1]
    assert alone == first == second


def test_bounded_cache_uses_less_memory_and_reports_stats(smollm):
    full = tokens(smollm, [LONG], None, n=48)
    tova = tokens(smollm, [LONG], make_policy("tova", budget=16), n=48)
    s_full, s_tova = full.stats[0], tova.stats[0]
    assert s_tova.peak_kv_bytes < s_full.peak_kv_bytes
    assert max(s_tova.final_kv_tokens) <= 16 * 3  # budget x kv heads per layer
    assert max(s_tova.peak_kv_tokens) <= max(s_full.peak_kv_tokens)
    assert s_tova.compression_events >= s_tova.generated_tokens - 1
    assert s_full.compression_events == 0
    assert s_full.final_kv_tokens == s_full.peak_kv_tokens
    assert s_full.tokens_per_s > 0 and s_full.prefill_s > 0


def test_sampling_is_seeded(smollm):
    a = tokens(smollm, [SHORT], None, temperature=0.9, top_p=0.9, top_k=50, seed=1).token_ids
    b = tokens(smollm, [SHORT], None, temperature=0.9, top_p=0.9, top_k=50, seed=1).token_ids
    c = tokens(smollm, [SHORT], None, temperature=0.9, top_p=0.9, top_k=50, seed=2).token_ids
    assert a == b and a != c


def test_stop_conditions_and_streaming_callback(smollm):
    model, tok = smollm
    streamed = {}
    result = generate(model, tok, [SHORT, LONG], None, GenerateConfig(max_new_tokens=6),
                      on_token=lambda row, ids: streamed.setdefault(row, []).extend(ids))
    assert [s.generated_tokens for s in result.stats] == [len(t) for t in result.token_ids]
    assert all(len(t) <= 6 for t in result.token_ids)
    assert streamed == {0: result.token_ids[0], 1: result.token_ids[1]}
    long_run = tokens(smollm, ["Say hello."], None, n=64)
    assert long_run.stats[0].finish_reason == "eos"
    assert long_run.token_ids[0][-1] in {tok.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}
    word = long_run.texts[0].split()[1]
    stopped = tokens(smollm, ["Say hello."], None, n=64, stop_strings=(word,))
    assert stopped.stats[0].finish_reason == "stop"
    assert word not in stopped.texts[0]


def test_each_row_is_handed_over_as_soon_as_it_ends(smollm):
    """on_finish gets a row that stops at EOS while its batch mate is still decoding, with the
    same text and statistics the result reports at the end."""
    model, tok = smollm
    calls = []
    result = generate(model, tok, ["Count from 1 to 100, separated by commas.", "Say hello."], None,
                      GenerateConfig(max_new_tokens=64),
                      on_finish=lambda row, text, stat, settings: calls.append((row, text, stat.generated_tokens, settings)))
    order = [c[0] for c in calls]
    assert sorted(order) == [0, 1]
    first, second = (result.stats[r] for r in order)
    assert first.finish_reason == "eos" and first.generated_tokens < second.generated_tokens  # it ended first
    assert [(c[1], c[2]) for c in calls] == [(result.texts[r], result.stats[r].generated_tokens) for r in order]
    assert all(c[3] == result.settings for c in calls)


def test_unsupported_model_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    with pytest.raises(ValueError, match="does not support model type 'gpt2'"):
        generate(model, None, ["hi"], None)


def test_attention_function_requires_a_sieve_step(smollm):
    model, tok = smollm
    model.set_attn_implementation("kvsieve")
    try:
        with pytest.raises(RuntimeError, match="kvsieve.generate"):
            model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        model.set_attn_implementation("sdpa")


def test_memory_limit_refuses_a_batch_that_does_not_fit_and_plans_an_upper_bound(smollm):
    from kvsieve.memory import KVMemoryError, planned_kv_bytes

    model, tok = smollm
    policy = make_policy("tova", budget=16)
    result = tokens(smollm, [SHORT, LONG], policy, n=40)
    prompt_len = max(s.prompt_tokens for s in result.stats)
    planned = planned_kv_bytes(model, policy, 2, prompt_len, 40)
    measured = sum(s.peak_kv_bytes for s in result.stats)
    assert measured <= planned
    full = tokens(smollm, [SHORT, LONG], None, n=40)
    assert sum(s.peak_kv_bytes for s in full.stats) <= planned_kv_bytes(model, make_policy("full"), 2, prompt_len, 40)
    with pytest.raises(KVMemoryError, match="use a batch of at most 1"):
        tokens(smollm, [SHORT, LONG], policy, n=40, kv_memory_gb=planned * 0.75 / 1024**3)


def test_a_cache_without_a_budget_is_never_grown_past_what_it_holds(smollm, monkeypatch):
    """LagKV without a budget bounds its own cache (Eq. 10): its store is never grown past the
    most tokens a head holds, or the prompt held whole before its first compression (growing
    by a whole 256-slot chunk after each compaction held up to 256 slots more), and the memory
    plan bounds the bytes it allocates below those of a cache that keeps everything."""
    from kvsieve.cache import SieveLayer
    from kvsieve.memory import planned_kv_bytes

    model, tok = smollm
    capacities = []
    original = SieveLayer.reserve

    def reserve(self, needed):
        original(self, needed)
        capacities.append(self.capacity)

    monkeypatch.setattr(SieveLayer, "reserve", reserve)
    policy, n = make_policy("lagkv", lag=8, ratio=0.25, sinks=4), 64
    result = tokens(smollm, [SHORT, LONG], policy, n=n, ignore_eos=True)
    prompt = max(s.prompt_tokens for s in result.stats)
    held = max(max(s.peak_kv_tokens) for s in result.stats) // model.config.num_key_value_heads
    assert held < prompt + n  # it compressed
    assert capacities and max(capacities) <= max(prompt, held)
    planned = planned_kv_bytes(model, policy, 2, prompt, n)
    assert sum(s.peak_kv_bytes for s in result.stats) <= planned < planned_kv_bytes(model, make_policy("full"), 2, prompt, n)


def test_random_weight_shapes_build_offline_and_say_speed_only(monkeypatch):
    from kvsieve import random_models
    from kvsieve.models import load_model

    tiny = ("qwen2", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=300, rope_theta=1e6))
    monkeypatch.setitem(random_models.SHAPES, "tiny", tiny)
    model, tok = load_model("random:tiny", device="cpu", dtype="float32")
    assert model.config.num_key_value_heads == 2 and model.dtype == torch.float32
    again, _ = load_model("random:tiny", device="cpu", dtype="float32")
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded
    full = generate(model, tok, ["hello", "a longer prompt"], None, GenerateConfig(max_new_tokens=6, ignore_eos=True))
    bounded = generate(model, tok, ["hello", "a longer prompt"], make_policy("tova", budget=64),
                       GenerateConfig(max_new_tokens=6, ignore_eos=True))
    assert full.token_ids == bounded.token_ids
    assert full.settings["weights"] == "random weights: speed only"
    with pytest.raises(ValueError, match="unknown random model shape"):
        load_model("random:nope", device="cpu")
    assert set(random_models.SHAPES) >= {"qwen2.5-1.5b", "qwen2.5-7b", "llama3.1-8b", "qwen3-8b"}


@pytest.mark.parametrize("method,budget,static", [("full", None, False), ("tova", 16, False), ("tova", 16, True),
                                                   ("lazy", 50, False), ("knorm", 16, False), ("caote:tova", 16, False)])
def test_reported_kv_bytes_are_the_bytes_torch_holds(smollm, monkeypatch, method, budget, static):
    """Every reading of the cache's size (the source of peak_kv_bytes) equals the bytes of the
    storages behind its tensors, counted once each: no view hides a larger buffer."""
    from kvsieve.cache import SieveCache

    model, tok = smollm
    readings = []
    reported = SieveCache.allocated_bytes

    def checked(cache):
        storages = {}
        for layer in cache.layers:
            if layer.is_initialized:
                for t in (layer.keys, layer.values, *layer.meta.values(), *layer.sums.values()):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        readings.append((reported(cache), sum(storages.values())))
        return readings[-1][0]

    monkeypatch.setattr(SieveCache, "allocated_bytes", checked)
    result = generate(model, tok, [SHORT, LONG], make_policy(method, budget=budget),
                      GenerateConfig(max_new_tokens=40, static_shapes=static))
    assert len(readings) > 1 and all(ours == torch_held for ours, torch_held in readings)
    assert all(0 < stat.peak_kv_bytes <= max(r[0] for r in readings) for stat in result.stats)  # a row's share
