"""``bounds.held_tokens``, the most a compressed request holds, against a step-by-step run of the
very rule the scheduler compacts with (``plan.keep_count``): the peak of blocks a request holds,
counted as vLLM's block lists do, never exceeds it and reaches it.  No vLLM needed."""

import pytest

from kvsieve.vllm.bounds import held_tokens
from kvsieve.vllm.paged import blocks_for
from kvsieve.vllm.plan import SieveSettings, keep_count


def _peak_blocks(settings: SieveSettings, block: int, prompt_len: int, max_len: int) -> int:
    """Blocks a request holds at most, stepping it as the scheduler does: its prompt prefilled,
    then each decode step compacted when ``keep_count`` says so (cut to the blocks of the kept
    tokens and this step's token, the cut ones held until the step has run), its token written."""
    kv, peak = prompt_len, blocks_for(prompt_len, block)
    for step in range(max_len - prompt_len):
        before = blocks_for(kv, block)  # held this step, cut or not
        keep = keep_count(settings, kv, step, prompt_len=prompt_len, block_size=block)
        if keep is not None and keep < kv:
            kv = keep
        kv += 1  # this step's token
        peak = max(peak, before, blocks_for(kv, block))
    return peak


CASES = [
    (SieveSettings(method="streaming", budget=128), 32),
    (SieveSettings(method="streaming", budget=100, interval=16), 32),
    (SieveSettings(method="tova", budget=64), 16),
    (SieveSettings(method="h2o", budget=128, interval=40), 32),
    (SieveSettings(method="expected", budget=256), 32),  # its own interval, above a block
    (SieveSettings(method="rkv", budget=128), 32),  # the prompt outside the budget
    (SieveSettings(method="snapkv", budget=96, compress_prefill=False), 32),
    (SieveSettings(method="lagkv", budget=512, horizon=2048), 32),  # a count rule of the length
]


@pytest.mark.parametrize("settings,block", CASES, ids=[s.method + str(s.interval) for s, _ in CASES])
@pytest.mark.parametrize("prompt_len", [10, 127, 128, 300, 333])
def test_the_bound_holds_every_step_and_is_reached(settings, block, prompt_len):
    max_len = 2048
    bound = held_tokens(settings, block, prompt_len, max_len)
    peak = _peak_blocks(settings, block, prompt_len, max_len) * block
    assert bound % block == 0
    if settings.policy.scorer.needs.uses_budget:
        assert peak == bound
    else:  # a count that grows with the length: its count at max_len, at most a block over the peak's
        assert peak <= bound <= peak + block


def test_a_short_request_holds_no_more_than_its_length():
    settings = SieveSettings(method="streaming", budget=128)
    assert held_tokens(settings, 32, 20, 100) == 128  # 100 tokens: four blocks, never the budget's five
    assert _peak_blocks(settings, 32, 20, 100) == 4


def test_full_holds_every_token():
    assert held_tokens(SieveSettings(), 32, 20, 1000) == 1024
