"""Schedule: the one object that decides when a policy compresses a cache, and does it.

A policy compresses at three kinds of moments (``Policy``'s schedule fields):

* after each block of the prompt, for block-wise prefill eviction (``prefill_block``, CAOTE
  Sec. 2 Eqs. 3-7), unless the prompt is protected (then no prompt token may go);
* at the end of the prompt: each row's prompt length is recorded (and, with ``protect_prompt``,
  every bounded layer's capacity sized for prompt + budget + interval), each layer drops its
  padding slots, then compresses the prompt when the policy does (``compress_prefill``);
* every ``interval`` decode steps, each layer over its bound (the budget, + the longest prompt
  with ``protect_prompt``).

Two drivers use it.  ``DecodeSession`` (kvsieve's own loop) knows its forward passes and calls
the cache-wide methods once per pass.  ``kvsieve.hf.ScheduledCache`` (transformers' ``generate``)
learns of a pass only through ``update(layer)``, so it asks the same questions and calls the
per-layer methods, one layer at a time, just before each layer is read again; layers are
independent, so both keep the same tokens.
"""

from __future__ import annotations

import torch

from .cache import SieveCache
from .policy import Policy, compress_layer, drop_dead_layer, set_prompt_bounds


class Schedule:
    """When and how ``policy`` compresses ``cache`` (rows of at most ``horizon`` tokens).

    ``budgets`` are the per-layer budgets (None: a layer the policy keeps whole), by default the
    policy's (``Policy.layer_budgets``).  Only a ``Schedule`` compresses, drops padding or records
    the prompt; the cache's layers change their own state in the calls it makes.
    """

    def __init__(self, policy: Policy, cache: SieveCache, horizon: int, budgets: list[int | None] | None = None):
        self.policy, self.cache, self.horizon = policy, cache, horizon
        self.budgets = policy.layer_budgets(len(cache.layers)) if budgets is None else budgets
        self.block = policy.prefill_block_size()  # the prompt is read in blocks of this many tokens

    # ------------------------------------------------------------------ when
    @property
    def compresses(self) -> bool:
        return self.policy.scorer is not None

    @property
    def compresses_blocks(self) -> bool:
        """Whether each prompt block is compressed as it arrives (a protected prompt has nothing to evict)."""
        return self.block is not None and not self.policy.protect_prompt

    def due(self, steps: int) -> bool:
        """Whether the compression of every ``interval`` decode steps falls on ``steps`` done."""
        return self.compresses and steps % self.policy.interval == 0

    def layer_due(self, index: int) -> bool:
        """Host-side: does layer ``index`` hold more than its bound now (no device read)?"""
        policy = self.policy
        if not self.compresses or (policy.protect_prompt and self.cache.prompt_len is None):
            return False
        bound = policy.layer_bound(self.cache, self.budgets[index])
        return policy.scorer.should_compress(self.cache.layers[index], bound)

    def any_due(self) -> bool:
        """Host-side: does any layer hold more than its bound now?"""
        return any(self.layer_due(index) for index in range(len(self.cache.layers)))

    # ------------------------------------------------------------------ what
    def compress_layer(self, index: int) -> bool:
        """Compress layer ``index`` down to its budget if it is over its bound; True if it was."""
        if not self.layer_due(index):
            return False
        compress_layer(self.cache.layers[index], self.policy, self.budgets[index], self.cache.seen_tokens,
                       self.policy.protected_prompt(self.cache), self.cache.prompt_max)
        return True

    def compress(self) -> bool:
        """Compress every layer over its bound; True if any was."""
        return any([self.compress_layer(index) for index in range(len(self.cache.layers))])

    def end_prompt(self, prompt_len: torch.Tensor) -> None:
        """The prompt is in: every row has seen its ``prompt_len`` [B] real tokens, and with
        ``protect_prompt`` each bounded layer's capacity makes room for its longest row's prompt."""
        self.cache.seen_tokens = prompt_len
        if self.compresses and self.policy.protect_prompt:
            set_prompt_bounds(self.cache, self.policy, self.budgets, self.horizon, prompt_len)

    @property
    def compresses_prompt(self) -> bool:
        """Whether the prompt is compressed once it is in (``compress_prefill``)."""
        return self.compresses and self.policy.compress_prefill

    def drop_padding(self, index: int, grow_chunk: int) -> None:
        """Layer ``index`` after the prompt: drop its padding slots, leaving room for the appends
        until the next compression (``grow_chunk`` for ``full``)."""
        headroom = self.policy.interval if self.compresses else grow_chunk
        # a policy that leaves the prompt for its first decode-time compression (LazyEviction, AMS,
        # SkipKV) needs those appends beyond its capacity hint when the prompt exceeds the budget
        drop_dead_layer(self.cache.layers[index], headroom, past_hint=self.compresses and not self.compresses_prompt)

    def finish_prompt(self, grow_chunk: int) -> bool:
        """Every layer after the prompt (``DecodeSession``): padding dropped, then the prompt
        compressed if the policy does.  True if any layer compressed."""
        for index in range(len(self.cache.layers)):
            self.drop_padding(index, grow_chunk)
        return self.compresses_prompt and self.compress()

    def finish_prompt_layer(self, index: int, grow_chunk: int) -> bool:
        """``finish_prompt`` for layer ``index`` alone (``ScheduledCache``, one layer at a time)."""
        self.drop_padding(index, grow_chunk)
        return self.compresses_prompt and self.compress_layer(index)
