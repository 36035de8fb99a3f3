"""transformers' own ``generate`` over a kvsieve cache.

::

    cache = kvsieve.SieveCache.for_model(model, method="lazy", budget=256)
    out = model.generate(**inputs, cache=cache, max_new_tokens=512)   # or past_key_values=cache

``SieveCache.for_model`` switches the model to kvsieve's attention function
(``model.set_attn_implementation("kvsieve")``; ``model.set_attn_implementation("sdpa")`` switches
back) and returns a ``ScheduledCache``: a ``SieveCache`` that runs its policy's schedule itself,
because transformers' loop tells a cache nothing but ``update(key, value, layer_idx)``.  One cache
serves one ``generate`` call.

How kvsieve's decode loop (``kvsieve.session``) maps onto those calls:

* Every forward pass calls ``update`` for layers 0, 1, ..., L-1 in order, so ``update(layer 0)``
  opens a pass: it counts the tokens of the pass before (``seen_tokens``, decode steps) and takes
  the positions of the new tokens.
* ``kvsieve.generate`` compresses after a pass (the prompt's clean-up and compression after the
  prefill, then every ``interval`` decode steps).  Here layer l is compressed at the start of its
  ``update`` in the next pass instead: nothing reads a layer between the two, so the tokens kept
  and the logits are the same, and after the last pass no compression is needed.
* Positions stay logical after eviction: the model takes them from ``position_ids``, which
  ``generate`` builds from the attention mask (``mask.cumsum(-1) - 1``, padding at 0) and extends by
  one per step, whatever the cache holds.  ``get_seq_length`` counts the (padded) tokens passed in,
  as ``DynamicCache`` does; masks are built by the attention function from each slot's position,
  so ``get_mask_sizes`` is never asked (kvsieve's attention has no transformers mask function).
* Left padding is read from those positions, once, on the host: a padding token has position 0
  and another position-0 token after it in its row.

Beam search, assisted decoding and contrastive search reorder, crop or copy cache rows, which a
bounded cache with per-row eviction state cannot do; they raise and name the alternative.
"""

from __future__ import annotations

import contextlib

import torch

from .attention import ATTN_IMPLEMENTATION, StepState, check_supported, set_scheduled_step
from .cache import DEAD_POS, SieveCache, serve_for_model
from .policy import Policy
from .schedule import Schedule, fitted, store_settings

_NO_REORDER = ("kvsieve caches keep per-row eviction state and cannot reorder, crop or copy rows, which beam "
               "search, assisted decoding and contrastive search need: use num_beams=1 without an assistant "
               "model (greedy or sampling), or kvsieve.generate")


def prompt_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions of a prompt as ``generate`` builds them (left padding at 0) -> the same with
    DEAD_POS on padding.  Checks the layout once on the host: each row is some padding, then its
    tokens at 0, 1, ..., n-1."""
    B, T = position_ids.shape
    zero = position_ids == 0
    zeros_after = zero.flip(-1).long().cumsum(-1).flip(-1) - zero.long()  # position-0 tokens to the right
    padding = zero & (zeros_after > 0)
    n = (~padding).sum(dim=-1, keepdim=True)  # [B, 1] real tokens per row
    expected = torch.arange(T, device=position_ids.device) - (T - n)  # [B, T]: position of each real slot
    if not bool(torch.where(expected >= 0, position_ids == expected, padding).all()):
        raise ValueError("kvsieve's cache needs each prompt row as left padding then positions 0, 1, ..., n-1: "
                         "tokenize with padding_side='left' and let generate build position_ids from the "
                         "attention mask")
    return position_ids.masked_fill(padding, DEAD_POS)


class ScheduledCache(SieveCache):
    """A ``SieveCache`` that drives its policy's schedule by itself (see the module docstring):
    the store is built from plain numbers (``schedule.store_settings``) and the ``Schedule`` it
    holds decides every eviction.  Build it with ``SieveCache.for_model``."""

    schedule: Schedule  # when each layer compresses; its block (block-wise prefill) must hold the prompt
    passes: int = 0  # forward passes opened
    steps: int = 0  # decode steps finished (the session's ``steps``)
    tokens_in: int = 0  # tokens passed in per row, padding included: what get_seq_length answers
    pending: str | None = None  # what each layer owes since the last pass: "prefill", "compress" or None
    step_state: StepState | None = None  # this pass's positions and observer, for the attention calls

    @classmethod
    def for_generate(cls, model, policy: Policy, horizon: int | None = None, tokenizer=None) -> "ScheduledCache":
        check_supported(model)
        if horizon is None:
            if policy.scorer is not None and not policy.scorer.needs.uses_budget and policy.budget is not None:
                raise ValueError(f"{policy.name} fits its own settings to the row length at a budget: pass "
                                 "horizon=<prompt tokens + max_new_tokens> to SieveCache.for_model")
            horizon = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        if policy.scorer is not None and policy.scorer.needs.per_token_hook:
            raise NotImplementedError(
                f"{policy.name} runs a host hook before every forward pass (SkipKV's sentence tracking), which "
                "transformers' generate cannot call: use kvsieve.generate for this method")
        policy = fitted(policy, horizon)  # the prompt is not seen yet: LagKV's fit does without it
        num_layers = model.config.num_hidden_layers
        cache = cls(num_layers, **store_settings(policy, num_layers, horizon))
        cache.schedule = Schedule(policy, cache, horizon)
        cache._hooks = contextlib.ExitStack()  # the scorer's per-call set-up (e.g. RoPE frequencies), for the cache's life
        if policy.scorer is not None:
            cache._hooks.enter_context(policy.scorer.attach(model, tokenizer))
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return cache

    # ------------------------------------------------------------------ the schedule
    def _open_pass(self, key_states: torch.Tensor, forward_kwargs: dict) -> None:
        """At layer 0: count the last pass, decide what each layer owes, position the new tokens."""
        B, _, T, _ = key_states.shape
        if self.passes == 0:  # the prompt
            position_ids = forward_kwargs.get("position_ids")
            if position_ids is None:
                raise RuntimeError("ScheduledCache.update got no position_ids from the model: this model "
                                   "family does not pass them to its attention layers; use kvsieve.generate")
            query_pos = prompt_positions(position_ids.expand(B, T))
            block = self.schedule.block
            if block is not None and T > block:
                raise ValueError(
                    f"{self.schedule.policy.name} evicts block-wise while prefilling (blocks of {block}), which needs "
                    f"the prompt in blocks, but transformers' generate passes its {T} tokens at once: use "
                    "kvsieve.generate, or prefill_block=False to compress the prompt once it is whole")
            self.set_seen(torch.zeros(B, dtype=torch.long, device=key_states.device))
            self._prompt_tokens = (query_pos != DEAD_POS).sum(dim=-1)
            self.pending = None
        else:
            if T != 1:
                raise ValueError("a ScheduledCache serves one generate call (one prompt, then one token per "
                                 "step): build a new one with SieveCache.for_model for every call")
            if self.passes == 1:  # the prefill is done: drop padding, compress the prompt
                self.schedule.record_prompt(self._prompt_tokens)
                self.pending = "prefill"
            else:
                self.set_seen(self.seen_tokens + 1)
                self.steps += 1
                self.pending = "compress" if self.schedule.due(self.steps) else None
            query_pos = self.seen_tokens[:, None]
        observe = self.passes == 0 or self.schedule.observes(self.steps)
        self.begin_step(query_pos)
        self.step_state = StepState(cache=self, query_pos=query_pos, observer=self.schedule.observer if observe else None)
        self.passes += 1
        self.tokens_in += T

    def _catch_up(self, layer_idx: int) -> None:
        """Layer ``layer_idx``'s compression owed since the last pass (``DecodeSession.prefill``'s
        end, or the compression after one of its steps), done now, before the layer is read again."""
        if self.pending is None:
            return
        if self.schedule.cross_layer:  # every layer at once, at layer 0, before any is read in this pass
            if layer_idx == 0 and self.pending == "prefill":
                self.schedule.finish_prompt(self.layers[0].grow_chunk)
            elif layer_idx == 0:
                self.schedule.compress()
            return
        if self.pending == "prefill":
            if self.schedule.compresses_blocks:  # block-wise: the one block, before padding goes
                self.schedule.compress_layer(layer_idx)
            self.schedule.finish_prompt_layer(layer_idx, self.layers[layer_idx].grow_chunk)
        else:
            self.schedule.compress_layer(layer_idx)

    # ------------------------------------------------------------------ transformers' Cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self._open_pass(key_states, kwargs.get("kwargs") or kwargs)
        self._catch_up(layer_idx)
        out = self.layers[layer_idx].update(key_states, value_states, self.query_pos)
        set_scheduled_step(self.step_state)
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.tokens_in

    def reorder_cache(self, beam_idx):
        raise NotImplementedError(_NO_REORDER)

    def crop(self, max_length):
        raise NotImplementedError(_NO_REORDER)

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError(_NO_REORDER)

    def batch_select_indices(self, indices):
        raise NotImplementedError(_NO_REORDER)


def cache_for_model(model, method: str = "full", budget: int | None = None, *, policy: Policy | None = None,
                    horizon: int | None = None, tokenizer=None, **settings) -> ScheduledCache:
    """``SieveCache.for_model``: a ``ScheduledCache`` for ``method`` at ``budget`` (or a ready ``policy``)."""
    from .methods import make_policy  # the methods load on first use

    if policy is None:
        policy = make_policy(method, budget, **settings)
    elif settings or budget is not None or method != "full":
        raise ValueError("pass either policy= or method/budget/settings to SieveCache.for_model, not both")
    return ScheduledCache.for_generate(model, policy, horizon=horizon, tokenizer=tokenizer)


serve_for_model(cache_for_model)
