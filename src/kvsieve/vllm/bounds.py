"""The most KV a compressed request holds, in blocks: what lets a server serve requests longer
than its KV pool (issue 59 item 1).  Plain Python: no vLLM import.

A request compressed by kvsieve's scheduler (``plan.keep_count``) holds its prompt until its
first compaction, then at most its count (the budget, + the prompt with ``protect_prompt``) plus
what the schedule lets it grow between two compactions.  Two uses:

* vLLM's start-up check asks each layer's KV cache spec for the most memory one request needs
  (``spec.SieveAttentionSpec``): a request of any length needs ``held_tokens`` of a prompt that fits
  in the budget, so ``--max-model-len`` may exceed the pool;
* a request is admitted only while the pool can hold the most every admitted request may hold
  (``SieveKVCacheManager``): then no request is ever preempted, which a request longer than the
  pool could not survive (its recompute, prompt and output at full length, would not fit).
"""

from __future__ import annotations

from .paged import blocks_for
from .plan import count_of


def held_tokens(settings, block_size: int, prompt_len: int, max_len: int, first: int | None = None) -> int:
    """The most tokens' worth of blocks (a multiple of ``block_size``) a request with a prompt of
    ``prompt_len`` tokens holds, over a life of at most ``max_len`` tokens, unless preempted, under
    ``settings`` (``plan.SieveSettings``) with the scheduler's ``block_size``:

    * the ``first`` tokens it holds before its first decode step (its prompt unless given: a
      prompt compressed between prefill chunks holds its count and one chunk), and the first
      sampled token's slot unless they are compressed at once (``compress_prefill``: the token
      then lands in the kept blocks);
    * the serving default (no interval set, ``plan.block_due``): a request of ``kv_len`` tokens is
      compacted to its count when ``kv_len`` is a multiple of the block and at least the method's
      interval over the count, so it never fills a block beyond ``count + interval``;
    * with an interval: compacted every ``interval`` decode steps while over its count, so it
      holds at most ``count + interval`` tokens, or, when its prompt is not compressed at once,
      ``prompt_len + interval``.

    A compaction cuts the block list to its kept blocks before the step's token is written
    (``Compaction.kept_blocks``); the cut blocks are held until the step has run, and never more
    than the list held before the cut.  ``max_len`` caps it: no request holds more than it has.
    Exact for a budget (tests/test_vllm_bounds.py steps ``keep_count``); for a count rule that
    grows with the length (LagKV) an upper bound, its count at ``max_len``."""
    if not settings.compresses:
        return blocks_for(max_len, block_size) * block_size
    policy = settings.policy
    count = count_of(settings, prompt_len, max_len)
    first = prompt_len if first is None else first
    at_once = policy.compress_prefill
    if settings.interval is None:
        grown = max(first + (0 if at_once else 1), count + policy.interval)
    else:
        grown = max(first, count + policy.interval) if at_once else max(first, count) + policy.interval
    return blocks_for(min(grown, max_len), block_size) * block_size
