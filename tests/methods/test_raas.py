"""RaaS (LazyEviction App. H.2): prompt tokens kept, timestamp-LRU over decode tokens."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.cache import SieveCache
from kvsieve.methods import make_policy
from kvsieve.methods.raas import RaaS
from kvsieve.schedule import compress_layer

schedule_module = importlib.import_module("kvsieve.schedule")  # the module that evicts, in the step and after it
SHORT = "What is 7 times 8?"  # 38 tokens with SmolLM2's chat template
MEDIUM = "Tell me a story about a fox and a heron."  # 42 tokens


def decode_steps(scorer, n_prompt, attended: dict, n_steps):
    """Prefill n_prompt tokens, then n_steps decode steps; attended[step position] lists the
    positions whose attention reaches alpha at that step (everything else gets 0)."""
    cache = SieveCache(1, meta_init=scorer.needs.meta, grow_chunk=8)
    cache.begin_step(torch.arange(n_prompt)[None])
    cache.update(torch.randn(1, 1, n_prompt, 4), torch.randn(1, 1, n_prompt, 4), 0)
    layer = cache.layers[0]
    scorer.observe(layer, torch.zeros(1, 1, 1, n_prompt, layer.capacity), torch.arange(n_prompt)[None])
    for p in range(n_prompt, n_prompt + n_steps):
        cache.begin_step(torch.tensor([[p]]))
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 0)
        probs = torch.zeros(1, 1, 1, 1, layer.capacity)
        for q in attended.get(p, []):
            probs[..., layer.meta["pos"][0, 0] == q] = 0.5
        scorer.observe(layer, probs, torch.tensor([[p]]))
    return layer


def test_prompt_flag_and_birth_timestamps():
    layer = decode_steps(RaaS(alpha=0.1), 4, {6: [1, 5]}, 4)
    assert layer.meta["prompt"][0, 0, :8].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert layer.meta["ts"][0, 0, :8].tolist() == [0, 6, 2, 3, 4, 6, 6, 7]  # birth stamps, refreshed at 6


def test_keeps_every_prompt_token_and_the_most_recently_attended_decode_tokens():
    policy = make_policy("raas", budget=8, alpha=0.1)
    assert (policy.interval, policy.recent, policy.sinks) == (1, 0, 0)  # a decision every step (App. C)
    # decode tokens 4..11; late attention refreshes 5 and 6, so 7, 8 (and 4) are the least recent
    layer = decode_steps(policy.scorer, 4, {10: [5], 11: [6]}, 8)
    compress_layer(layer, policy, 8, torch.tensor([12]))
    assert layer.meta["pos"][0, 0, :8].tolist() == [0, 1, 2, 3, 5, 6, 10, 11]


def test_prompt_tokens_outrank_decode_tokens_even_when_never_attended():
    policy = make_policy("raas", budget=6, alpha=0.1)
    layer = decode_steps(policy.scorer, 4, {p: [p] for p in range(4, 10)}, 6)  # decode tokens self-attend
    compress_layer(layer, policy, 6, torch.tensor([10]))
    assert layer.meta["pos"][0, 0, :6].tolist() == [0, 1, 2, 3, 8, 9]


def test_a_prompt_longer_than_the_budget_is_cut_least_recently_attended_first():
    """App. H.3's limitation: the budget is saturated by the prompt."""
    policy = make_policy("raas", budget=3, alpha=0.1)
    layer = decode_steps(policy.scorer, 5, {5: [0], 6: [3]}, 2)
    compress_layer(layer, policy, 3, torch.tensor([7]))
    assert layer.meta["pos"][0, 0, :3].tolist() == [0, 3, 4]  # stamps 5, 6, 4 beat 1, 2 and decode


def test_alpha_follows_the_family_table():
    assert RaaS(family="qwen2").alpha == 1e-4 and RaaS(family="llama").alpha == 5e-4 and RaaS(alpha=2e-3).alpha == 2e-3
    with pytest.raises(ValueError, match="raas head_reduction"):
        RaaS(head_reduction="median")


def test_end_to_end_prompts_survive_and_eviction_is_lru(smollm, monkeypatch):
    """Every eviction of a real run (RaaS evicts in place inside the decode step; a prompt
    longer than the budget is compressed by ``compress``) keeps every prompt token and drops
    the least recently attended decode tokens first."""
    model, tok = smollm
    budget = 48
    policy = make_policy("raas", budget=budget, family="llama")
    checked = []

    def check_layer(layer, pol, seen, run):
        pos, score, prompt = (layer.meta["pos"].clone(), pol.scorer.score(layer, seen).clone(),
                              layer.meta["prompt"].clone())
        result = run()
        live = pos != torch.iinfo(torch.int32).max
        kept = (pos[..., :, None] == layer.meta["pos"][..., None, :]).any(-1) & live
        assert (kept | ~(live & (prompt > 0))).all()  # every prompt token kept
        decode = live & (prompt == 0)
        low_kept = score.masked_fill(~(kept & decode), float("inf")).amin(-1)
        high_evicted = score.masked_fill(~(~kept & decode), float("-inf")).amax(-1)
        assert (low_kept >= high_evicted).all()  # least recently attended go first
        assert (layer.lengths <= budget).all()
        checked.append(True)
        return result

    real_evict, real_compress_layer = schedule_module.evict_in_place, schedule_module.compress_layer
    monkeypatch.setattr(schedule_module, "evict_in_place", lambda layer, pol, b, seen, excess, scores=None, prompt_len=None,
                        max_len=None, pinned=None: check_layer(
        layer, pol, seen, lambda: real_evict(layer, pol, b, seen, excess, scores, prompt_len, max_len, pinned)))
    monkeypatch.setattr(schedule_module, "compress_layer", lambda layer, pol, b, seen, *prompt: check_layer(
        layer, pol, seen, lambda: real_compress_layer(layer, pol, b, seen, *prompt)))
    result = generate(model, tok, [SHORT, MEDIUM], policy, GenerateConfig(max_new_tokens=24))
    assert len(checked) >= 30  # evictions really ran (30 layers)
    assert all(s.compression_events > 0 for s in result.stats)
