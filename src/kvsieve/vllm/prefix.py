"""Prefix caching with eviction (issue 59 item 2).  Plain Python: no vLLM import.

vLLM caches a request's full blocks by the hash of the tokens they hold, and a later request whose
prompt starts with the same tokens reads those very blocks.  A compaction rewrites a request's
blocks, so a block that may be shared must hold tokens no compaction moves.  kvsieve's compaction
writes each (layer, kv head)'s kept tokens into the request's first slots in slot order
(``schedule.keep_set``), so a prompt prefix that every head keeps whole stays where it was, byte
for byte:

* ``protect_prompt``: the whole prompt, kept outside the budget;
* ``pin_prompt`` (TriAttention's default): the prompt's first ``min(prompt, budget)`` tokens, kept
  inside it.

Only the full blocks of that prefix are cached and hit (``shared_tokens``); blocks after it, which
compactions rewrite, are never cached, so a compacted block is never shared.  A method whose
prompt competes with the output keeps no such prefix: refused with prefix caching on
(``uncacheable``), as is a scorer that needs queries or hidden states a cache hit never computes.
"""

from __future__ import annotations


def shared_tokens(policy, prompt_len: int, block_size: int) -> int:
    """Tokens at the start of a request's prompt that no compaction moves under ``policy`` (a
    ``kvsieve.policy.Policy``), in whole blocks of ``block_size``: the only ones vLLM may cache
    and share."""
    if policy.scorer is None:  # method full: nothing moves
        kept = prompt_len
    elif policy.protect_prompt:
        kept = prompt_len
    elif policy.pin_prompt:
        kept = min(prompt_len, policy.budget)
    else:
        kept = 0
    return kept // block_size * block_size


def uncacheable(policy, method: str) -> str | None:
    """Why ``policy`` cannot run with vLLM's prefix caching, in one phrase naming the setting to
    change, or None when it can."""
    if policy.scorer is None:
        return None
    if not (policy.protect_prompt or policy.pin_prompt):
        return (f"{method} lets the prompt compete with the output, so compactions rewrite the prompt's blocks "
                "that prefix caching shares: set protect_prompt=true (the prompt kept outside the budget), or turn "
                "prefix caching off (--no-enable-prefix-caching)")
    needs = policy.scorer.needs
    if needs.sentences:
        return (f"{method} reads every token's last hidden state (SkipKV's sentences), which a prefix-cache hit never "
                "computes: turn prefix caching off (--no-enable-prefix-caching)")
    if needs.observes and not needs.observes_last_only:
        return (f"{method} replays the attention of every query since the prompt, and a prefix-cache hit computes "
                "none of the cached prompt's queries: turn prefix caching off (--no-enable-prefix-caching)")
    # a scorer of the last w queries reads only decode queries at its first compaction when that
    # comes after w decode steps: with the prompt protected, after more than `budget` of them
    if needs.query_window > 1 and not (policy.protect_prompt and policy.budget >= needs.query_window):
        return (f"{method} scores with its last {needs.query_window} queries, which may reach into a cached prompt "
                f"whose queries a prefix-cache hit never computes: set protect_prompt=true with a budget of at "
                f"least {needs.query_window}, or turn prefix caching off (--no-enable-prefix-caching)")
    return None
