"""transformers' own ``model.generate`` over ``SieveCache.for_model``: the same tokens as
``kvsieve.generate`` for the same method and budget, and clear errors for what it cannot do."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from kvsieve import GenerateConfig, SieveCache, generate, make_policy
from kvsieve.hf import prompt_positions

PROMPTS = ["The capital of France is", "Count: one, two, three, four, five, six, seven, eight"]
NEW = 28


@pytest.fixture
def model_tok(smollm):
    """The bundled model, switched back to its own attention after each test (for_model switches it)."""
    model, tok = smollm
    previous = model.config._attn_implementation
    yield model, tok
    model.set_attn_implementation(previous)


def hf_tokens(model, tok, cache, **kwargs):
    """New token ids per row from transformers' generate, cut after the first EOS."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, cache=cache, max_new_tokens=NEW, do_sample=False, **kwargs)
    rows = out[:, enc.input_ids.shape[1]:].tolist()
    eos = tok.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


# Every-step in-place eviction (tova, its prompt protected), an interval policy that leaves the prompt for
# decode (lazy), a wrapper whose scorer rides the attention pass (caote:tova); the rest under slow (tova with
# its prompt competing is also the golden test's default hf case, hf-tova@64).
CASES = [("full", None, {}), ("tova", 16, {"protect_prompt": True}), ("lazy", 32, {"window": 8}),
         ("caote:tova", 24, {})]
SLOW_CASES = [("tova", 24, {}), ("snapkv", 24, {"recent": 8}), ("h2o", 24, {}), ("streaming", 24, {}), ("expected", 24, {}),
              ("rkv", 12, {"recent": 4}), ("knorm", 24, {}), ("ams:tova", 24, {"recent": 8}),
              ("lagkv", 24, {"sinks": 4, "off_grid": True})]  # 24 is below the paper's grid


@pytest.mark.parametrize("method,budget,settings",
                         CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CASES])
def test_transformers_generate_matches_kvsieve_generate(model_tok, method, budget, settings):
    model, tok = model_tok
    ref = generate(model, tok, PROMPTS, make_policy(method, budget, **settings),
                   GenerateConfig(max_new_tokens=NEW, chat_template=False))
    horizon = max(len(tok(p).input_ids) for p in PROMPTS) + NEW
    cache = SieveCache.for_model(model, method, budget, horizon=horizon, **settings)
    assert hf_tokens(model, tok, cache) == ref.token_ids
    if budget is not None:
        assert sum(s.compression_events for s in ref.stats) > 0  # the comparison covers compressions
        policy = make_policy(method, budget, **settings)
        extra = policy.interval + (cache.prompt_max if policy.protect_prompt else 0)
        for layer, layer_budget in zip(cache.layers, cache.schedule.budgets):  # None: a layer the method keeps whole
            if layer_budget is not None and policy.scorer.needs.uses_budget:  # (LagKV keeps by partitions)
                assert int(layer.lengths.max()) <= layer_budget + extra


def test_streamer_and_sampling(model_tok):
    """A streamer sees every new token; sampling runs and the cache stays bounded."""
    model, tok = model_tok

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            pass

    streamer = Collect()
    enc = tok([PROMPTS[1]], return_tensors="pt")
    cache = SieveCache.for_model(model, "tova", 16)
    out = model.generate(**enc, cache=cache, max_new_tokens=24, do_sample=True, top_k=20, streamer=streamer)
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]  # the first put is the prompt
    assert streamed == out[0, enc.input_ids.shape[1]:].tolist()
    assert max(int(layer.lengths.max()) for layer in cache.layers) <= 17


def test_errors_name_the_alternative(model_tok):
    model, tok = model_tok
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with pytest.raises(NotImplementedError, match="num_beams=1"):
        model.generate(**enc, cache=SieveCache.for_model(model, "tova", 16), max_new_tokens=4, num_beams=2,
                       do_sample=False)
    with pytest.raises(NotImplementedError, match="kvsieve.generate"):
        SieveCache.for_model(model, "skipkv", 64)
    with pytest.raises(ValueError, match="horizon"):
        SieveCache.for_model(model, "lagkv", 64)
    cache = SieveCache.for_model(model, "tova", 16)
    model.generate(**enc, cache=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="new one"):
        model.generate(**enc, cache=cache, max_new_tokens=2, do_sample=False)
    right = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="right")
    with pytest.raises(ValueError, match="padding_side='left'"):
        model.generate(**right, cache=SieveCache.for_model(model, "tova", 16), max_new_tokens=2, do_sample=False)
    with pytest.raises(RuntimeError, match="set_attn_implementation"):
        model(**enc)  # kvsieve attention without a kvsieve cache


def test_prompt_positions_marks_left_padding():
    pos = torch.tensor([[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0]])
    out = prompt_positions(pos)
    dead = out == torch.iinfo(torch.int32).max
    assert dead.tolist() == [[True, True, True, False, False, False], [False] * 6, [True] * 5 + [False]]
    with pytest.raises(ValueError, match="left"):
        prompt_positions(torch.tensor([[0, 1, 2, 0, 0]]))  # right padding
