"""``Needs.observes_steps``: a scorer that declares it, handed T decode steps' attention rows in one
``observe(..., steps=True)`` call over a layer that already holds every slot those steps
appended (vLLM's replay of a request's queries since its last compaction, ``store.observe_since``),
leaves the per-token state that T one-query calls leave when each call sees the layer as it was
at its step (later slots not yet cached), as kvsieve's engine feeds it.  The reference here is
those T calls, each with its own attention over the slots cached by then."""

import dataclasses

import pytest
import torch

from kvsieve.attention import attention_probs, visible
from kvsieve.cache import DEAD_POS, LayerView
from kvsieve.methods import make_policy
from kvsieve.methods.h2o import H2O
from kvsieve.methods.lazy import LazyEviction
from kvsieve.methods.raas import RaaS
from kvsieve.methods.tova import TOVA

B, H, G, D, S, T = 2, 2, 3, 8, 30, 12
SCALING = D ** -0.5
ALPHA = 0.03  # a threshold that about a third of the attention entries here reach

SCORERS = {
    "h2o": lambda: H2O(),
    "lazy": lambda: LazyEviction(alpha=ALPHA),
    "raas": lambda: RaaS(alpha=ALPHA),
}


def _layer(seed: int) -> tuple[LayerView, torch.Tensor, torch.Tensor]:
    """A layer after a compaction plus the T slots its steps appended since, all of them cached:
    row 0 keeps positions 0..17 and appended 18..29; row 1 keeps 18 scattered positions below 40
    and appended 40..51.  Returns the layer, the T queries [B, H_q, T, D] and their positions
    [B, T] (step t's query sits at the slot step t appended)."""
    g = torch.Generator().manual_seed(seed)
    kept = S - T
    row1 = torch.randperm(40, generator=g)[:kept].sort().values
    pos = torch.stack([torch.arange(S), torch.cat([row1, torch.arange(40, 40 + T)])])  # [B, S]
    pos = pos[:, None].expand(B, H, S).clone()
    keys, values = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    old = torch.arange(S) < kept  # [S]: slots from before the compaction carry state; the rest start fresh
    meta = {
        "pos": pos,
        "acc": torch.where(old, torch.rand(B, H, S, generator=g), 0.0),
        # timestamps: a kept token's last activation, a step from its birth (its position) to the last
        # kept position; -1 (unset) on the new slots
        "ts": torch.where(old, pos + (torch.rand(B, H, S, generator=g) * (pos[:, :, kept - 1:kept] - pos + 1)).floor(),
                          -1.0),
        "mri": torch.where(old, torch.randint(0, 9, (B, H, S), generator=g).float(), 0.0),
        "prompt": torch.where(old & (pos < 10), 1.0, 0.0),
    }
    view = LayerView(keys, values, torch.full((B, H), S), meta, {}, None, None, SCALING, {}, 0, S)
    queries = torch.randn(B, H * G, T, D, generator=g)
    query_pos = pos[:, 0, kept:]  # [B, T]: step t's query sits at the slot step t appended
    return view, queries, query_pos


def _step_by_step(scorer, layer: LayerView, queries: torch.Tensor, query_pos: torch.Tensor) -> dict:
    """T calls of one query, each over the layer as it was at its step (later slots dead)."""
    state = {name: t.clone() for name, t in layer.meta.items()}
    for t in range(T):
        qpos = query_pos[:, t:t + 1]  # [B, 1]
        then_pos = state["pos"].masked_fill(state["pos"] > qpos[:, :, None], DEAD_POS)
        then = dataclasses.replace(layer, meta={**state, "pos": then_pos})
        probs = attention_probs(queries[:, :, t:t + 1], layer.keys, visible(then_pos, qpos), SCALING)
        scorer.observe(then, probs, qpos)
        state.update({name: v for name, v in then.meta.items() if name != "pos"})
    return state


def _at_once(scorer, layer: LayerView, queries: torch.Tensor, query_pos: torch.Tensor) -> dict:
    state = {name: t.clone() for name, t in layer.meta.items()}
    view = dataclasses.replace(layer, meta=state)
    probs = attention_probs(queries, layer.keys, visible(state["pos"], query_pos), SCALING)  # [B, H, G, T, S]
    scorer.observe(view, probs, query_pos, steps=True)
    return view.meta


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", sorted(SCORERS))
def test_t_steps_in_one_call_leave_the_state_of_t_calls(name, seed):
    scorer = SCORERS[name]()
    assert scorer.needs.observes_steps
    layer, queries, query_pos = _layer(seed)
    expected = _step_by_step(scorer, layer, queries, query_pos)
    got = _at_once(scorer, layer, queries, query_pos)
    for field in scorer.needs.meta:
        if field == "acc":  # a sum over the T rows, its adds in another order: equal to rounding
            torch.testing.assert_close(got[field], expected[field], rtol=1e-6, atol=1e-6)
        else:  # integer timestamps, gaps and flags: exact
            assert torch.equal(got[field], expected[field]), field
        if field == "prompt":  # RaaS: decode steps are not prompt, whatever their count
            assert torch.equal(got[field], layer.meta[field])
        else:
            assert not torch.equal(expected[field], layer.meta[field]), f"{field}: the steps changed nothing"


def test_a_multi_query_call_without_steps_is_still_a_prefill_chunk():
    """Without ``steps`` LazyEviction takes T rows for the prompt: every token born at the chunk's
    last query, no recurrence gap (Alg. 1 runs over decoding steps only); RaaS marks them prompt."""
    layer, queries, query_pos = _layer(0)
    probs = attention_probs(queries, layer.keys, visible(layer.meta["pos"], query_pos), SCALING)
    lazy_view = dataclasses.replace(layer, meta={n: t.clone() for n, t in layer.meta.items()})
    LazyEviction(alpha=ALPHA).observe(lazy_view, probs, query_pos)
    assert torch.equal(lazy_view.meta["ts"], query_pos[:, -1, None, None].float().expand(B, H, S))
    assert torch.equal(lazy_view.meta["mri"], layer.meta["mri"])
    raas_view = dataclasses.replace(layer, meta={n: t.clone() for n, t in layer.meta.items()})
    RaaS(alpha=ALPHA).observe(raas_view, probs, query_pos)
    assert bool((raas_view.meta["prompt"] == 1.0).all())


def test_only_scorers_whose_steps_add_up_declare_it():
    """TOVA keeps the newest row only (it is never replayed); CAOTE's value mix is one step's."""
    assert not TOVA.needs.observes_steps
    assert not make_policy("caote:h2o", budget=128).scorer.needs.observes_steps
    assert make_policy("ams:h2o", budget=128).scorer.needs.observes_steps
