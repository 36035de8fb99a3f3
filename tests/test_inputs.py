"""Issue 33: every input gets a clear answer.  Each bad input here is refused with its exact one-line
message (or, for sliding-window attention, gives the correct output), in the caller's terms."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvsieve import GenerateConfig, SieveCache, generate, make_policy
from kvsieve.random_models import ByteTokenizer
from kvsieve.steering import Steering, SteeringVector, model_fingerprint, model_name

PROMPTS = ["the quick brown fox jumps over the lazy dog", "a b c d e f g h"]


def tiny(model_type: str = "llama", **fields):
    """A two- or three-layer random model over byte tokens (no download, a second to build)."""
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=258, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**shape, **fields})).eval()
    model.generation_config.eos_token_id = ByteTokenizer.eos_token_id
    return model, ByteTokenizer()


def message(fn, *args, error=ValueError, **kwargs) -> str:
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------- sliding windows
def sdpa_tokens(model, tok, new: int) -> list[list[int]]:
    """Greedy new tokens per prompt from transformers' own sdpa attention (the reference)."""
    model.set_attn_implementation("sdpa")
    ids = [tok(p).input_ids for p in PROMPTS]
    width = max(map(len, ids))
    input_ids = torch.tensor([[ByteTokenizer.pad_token_id] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=ByteTokenizer.pad_token_id)
    return out[:, width:].tolist()


SLIDING = {
    "mistral, window 4 in every layer": ("mistral", dict(sliding_window=4)),
    "qwen2, use_sliding_window from layer 1": ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                                                             max_window_layers=1, num_hidden_layers=3)),
}


@pytest.mark.parametrize("case", list(SLIDING))
def test_full_cache_honours_each_layers_sliding_window_as_sdpa_does(case):
    """Mistral's window used to be ignored (different tokens from sdpa, no error); now a left-padded
    batch decodes the same tokens as transformers' sdpa, through kvsieve.generate and through
    transformers' generate over a SieveCache."""
    model_type, fields = SLIDING[case]
    model, tok = tiny(model_type, **fields)
    reference = sdpa_tokens(model, tok, 16)
    config = GenerateConfig(max_new_tokens=16, ignore_eos=True)
    assert generate(model, tok, PROMPTS, make_policy("full"), config).token_ids == reference
    # h2o at a budget nothing reaches: its observed attention rows (the other attention path) see the window too
    assert generate(model, tok, PROMPTS, make_policy("h2o", budget=256), config).token_ids == reference
    model.set_attn_implementation("sdpa")
    without_window = tiny(model_type, **{**fields, "sliding_window": None, "use_sliding_window": False})[0]
    assert generate(without_window, tok, PROMPTS, make_policy("full"), config).token_ids != reference  # it matters
    enc_ids = [tok(p).input_ids for p in PROMPTS]
    width = max(map(len, enc_ids))
    input_ids = torch.tensor([[ByteTokenizer.pad_token_id] * (width - len(r)) + r for r in enc_ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in enc_ids])
    hf = model.generate(input_ids=input_ids, attention_mask=mask, cache=SieveCache.for_model(model, method="full"),
                        max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=ByteTokenizer.pad_token_id)
    assert hf[:, width:].tolist() == reference


def test_a_layer_type_kvsieve_cannot_compute_is_refused():
    model, tok = tiny("qwen3", layer_types=["full_attention", "chunked_attention"])
    assert message(generate, model, tok, ["hi"]) == (
        "model 'qwen3' has attention layers of type ['chunked_attention']; kvsieve supports full_attention and "
        "sliding_attention layers only.")


# ---------------------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def llama():
    return tiny(max_position_embeddings=64)


def test_a_bare_string_is_one_prompt(llama):
    model, tok = llama
    config = GenerateConfig(max_new_tokens=3)
    one = generate(model, tok, "Hi", config=config)
    assert len(one.texts) == len(one.stats) == 1 and one.stats[0].prompt_tokens == 2
    assert one.token_ids == generate(model, tok, ["Hi"], config=config).token_ids


KINDS = "must be text, a list of chat messages ({'role': ..., 'content': ...}) or a list of token ids (ints), got"


@pytest.mark.parametrize("prompts,expected", [
    (["a", None], f"prompts[1] {KINDS} None"),
    (["a", 1], f"prompts[1] {KINDS} 1 (int)"),
    ([[1, 2.5]], f"prompts[0] {KINDS} [1, 2.5] (list)"),
    ([torch.tensor([1, 2])], f"prompts[0] {KINDS} tensor([1, 2]) (Tensor); pass ids.tolist(), without padding"),
    (torch.tensor([[1, 2]]), "prompts must be lists of token ids, not a tensor (1, 2): pass ids.tolist(), one list "
                             "per prompt without its padding"),
    ([[]], "empty prompt: every prompt needs at least one token"),
    ([[5, 258]], "prompt 0 holds token id 258, outside the model's vocabulary 0..257; pass ids from this model's "
                 "tokenizer"),
    ([{"role": "user", "content": "hi"}], f"prompts[0] {KINDS} {{'role': 'user', 'content': 'hi'}} (dict); to pass "
     "one conversation, wrap it in a list: [messages]"),
])
def test_prompts_of_another_type_are_refused_by_index(llama, prompts, expected):
    model, tok = llama
    assert message(generate, model, tok, prompts) == expected


@pytest.mark.parametrize("kwargs,expected", [
    (dict(policy="tova"), "policy= must be a Policy, e.g. make_policy('tova', budget=128), got 'tova' (str)"),
    (dict(config={"max_new_tokens": 2}), "config= must be a GenerateConfig, e.g. GenerateConfig(max_new_tokens=64), "
                                         "got {'max_new_tokens': 2} (dict)"),
])
def test_a_policy_or_config_of_another_type_is_refused_by_keyword(llama, kwargs, expected):
    """They used to raise AttributeErrors from deep inside (no attribute 'for_horizon', 'chat_template')."""
    model, tok = llama
    assert message(generate, model, tok, ["hi"], **kwargs) == expected


def test_token_id_prompts_decode_as_their_text_does(llama):
    """A list of ints is one prompt of token ids, taken as given; a list of such lists is a batch."""
    model, tok = llama
    config = GenerateConfig(max_new_tokens=6, ignore_eos=True)
    ids = [tok(p).input_ids for p in PROMPTS]
    assert generate(model, tok, ids, config=config).token_ids == generate(model, tok, PROMPTS, config=config).token_ids
    assert generate(model, tok, ids[0], config=config).token_ids == generate(model, tok, PROMPTS[0], config=config).token_ids
    mixed = generate(model, tok, [PROMPTS[0], tuple(ids[1])], config=config)
    assert mixed.token_ids == generate(model, tok, PROMPTS, config=config).token_ids


@pytest.mark.parametrize("hooks,expected", [
    (lambda vec: Steering(vec), "hooks= takes a list of hooks: hooks=[Steering(...)]"),
    (lambda vec: [print], "hooks[0] must have name, attach(model, tokenizer) and settings() (a kvsieve.hooks.Hook, "
                          "e.g. kvsieve.steering.Steering), got <built-in function print> (builtin_function_or_method)"),
    (lambda vec: [Steering(vec), Steering(vec, alpha0=2.0)],
     "hooks ['steering'] given more than once: pass one hook of each name"),
])
def test_hooks_that_are_not_a_list_of_hooks_are_refused(llama, hooks, expected):
    model, tok = llama
    vec = SteeringVector(torch.ones(32), 1, model_name(model), model_fingerprint(model))
    assert message(generate, model, tok, ["hi"], hooks=hooks(vec)) == expected


def test_a_prompt_longer_than_the_context_is_refused_and_one_that_runs_past_it_warned(llama):
    model, tok = llama
    assert message(generate, model, tok, ["hi", "x" * 65], config=GenerateConfig(max_new_tokens=2)) == (
        "prompt 1 has 65 tokens, more than the model's context of 64 (max_position_embeddings); shorten it")
    with pytest.warns(UserWarning, match="prompt 0 has 60 tokens: with max_new_tokens=5 its generation may run past "
                                         "the model's context of 64 tokens"):
        generate(model, tok, ["x" * 60], config=GenerateConfig(max_new_tokens=5))


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize("call,expected", [
    (lambda: make_policy("tova", budget="32"), "budget= must be an integer, got '32' (str)"),
    (lambda: make_policy("tova", budget=32.5), "budget= must be an integer, got 32.5 (float)"),
    (lambda: make_policy("tova", budget=32, sinks=1.5), "sinks= must be an integer, got 1.5 (float)"),
    (lambda: make_policy("tova", budget=32, interval="abc"), "interval= must be an integer, got 'abc' (str)"),
    (lambda: make_policy("snapkv", budget=32, window="abc"), "window= must be an integer, got 'abc' (str)"),
    (lambda: make_policy("caote:tova", budget=32, protect_prompt="yes"),
     "protect_prompt= must be true or false, got 'yes' (str)"),
    (lambda: make_policy("tova", budget=32, allocator="pyramid", allocator_beta="x"),
     "allocator_beta= must be a number, got 'x' (str)"),
    (lambda: GenerateConfig(max_new_tokens=2.5), "max_new_tokens= must be an integer, got 2.5 (float)"),
    (lambda: GenerateConfig(temperature=float("nan")), "temperature= must be a number, got nan (float)"),
    (lambda: GenerateConfig(stop_strings="\n"), "stop_strings= must be a list of texts, got '\\n' (str)"),
    (lambda: GenerateConfig(top_p=0), "top_p= must be in (0, 1], got 0"),
    (lambda: GenerateConfig(kv_memory_gb=-1), "kv_memory_gb= is the KV cache memory a batch may plan, in GiB: it "
                                              "must be > 0, got -1"),
])
def test_a_setting_of_the_wrong_type_or_range_is_one_line_naming_the_keyword(call, expected):
    assert message(call) == expected


@pytest.mark.parametrize("name,expected", [
    ("tovaa", "unknown method 'tovaa' (did you mean tova?); choose one of: "),
    ("caote", "method 'caote' wraps another method: name its base, e.g. caote:tova (caote:<base>)"),
    ("coate:tova", "unknown method wrapper 'coate' in 'coate:tova' (did you mean caote?); wrappers: ams, "
                   "ams-released, caote, fastcaote"),
])
def test_an_unknown_method_suggests_the_nearest_name_and_lists_the_wrappers(name, expected):
    text = message(make_policy, name, budget=32)
    assert text.startswith(expected)
    if name == "tovaa":
        from kvsieve.methods import method_names

        assert text.endswith(f"{', '.join(method_names())}; or a wrapper: ams:<base>, ams-released:<base>, "
                             "caote:<base>, fastcaote:<base>")


# ---------------------------------------------------------------------------- steering vectors
def vector(model, values: torch.Tensor, layer: int = 1) -> SteeringVector:
    return SteeringVector(values, layer, model_name(model), model_fingerprint(model), {})


@pytest.mark.parametrize("values,expected", [
    (torch.full((32,), float("nan")), "steering vector has 32 of 32 values that are not finite (nan or inf); "
                                      "rebuild it (kvsieve steering build)"),
    (torch.ones(32).index_fill(0, torch.tensor([3]), float("inf")),
     "steering vector has 1 of 32 values that are not finite (nan or inf); rebuild it (kvsieve steering build)"),
    (torch.ones(2, 32), "a steering vector is one row of floats [hidden_size], got (2, 32)"),
    (torch.ones(32, dtype=torch.long), "a steering vector is one row of floats [hidden_size], got (32,)"),
])
def test_a_steering_vector_that_is_not_finite_floats_is_refused(llama, values, expected):
    assert message(vector, llama[0], values) == expected


@pytest.mark.parametrize("values,layer,expected", [
    (torch.ones(16), 1, "steering vector has 16 values; the model's hidden size is 32"),
    (torch.ones(32), 2, "steering layer 2 is outside the model's layers 0..1"),
    (torch.ones(32), -1, "steering layer -1 is outside the model's layers 0..1"),
])
def test_a_steering_vector_of_the_wrong_length_or_layer_is_refused_before_decoding(llama, values, layer, expected):
    model, _ = llama
    forged = vector(model, values, layer)
    assert message(forged.check, model) == expected  # the CLI's check of a file
    assert message(Steering(forged).attach(model, None).__enter__) == expected  # generate(..., hooks=[steering])


def test_a_steering_vector_built_for_another_model_is_refused_naming_the_fix(llama):
    """generate(hooks=[Steering(vector)]) used to say only "steering vector for {...} used on {...}"."""
    model, tok = llama
    built_for = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 30, "vocab_size": 49152}
    forged = SteeringVector(torch.ones(32), 1, "smollm2-135m", built_for, {})
    assert message(generate, model, tok, ["hi"], hooks=[Steering(forged)]) == (
        f"steering vector was built for smollm2-135m {built_for}, not for unknown {{'model_type': 'llama', "
        "'hidden_size': 32, 'num_hidden_layers': 2, 'vocab_size': 258}; build one for this model "
        "(kvsieve steering build --model ...)")


def test_steering_strengths_are_type_checked():
    assert message(Steering, None, alpha0="1") == "alpha0= must be a number, got '1' (str)"


# ---------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("method,settings,peak,steady", [
    ("tova", {}, 60, 16 + 1),  # the prompt held whole after prefill; then budget + the token of each step
    ("lazy", {"window": 4}, 60 + 4, 16 + 4),  # compresses after W decode steps: prompt + W; then B + W
    ("full", {}, 60 + 20 - 1, 0),  # never compresses: no steady state
])
def test_the_steady_peak_leaves_out_the_prompt_held_before_the_first_compression(method, settings, peak, steady):
    model, tok = tiny()  # 2 kv heads; a 60-byte prompt is 60 tokens, over the budget of 16
    policy = make_policy(method, budget=None if method == "full" else 16, **settings)
    stat = generate(model, tok, ["x" * 60], policy, GenerateConfig(max_new_tokens=20, ignore_eos=True)).stats[0]
    assert stat.peak_kv_tokens == [2 * peak] * 2  # per layer, summed over the kv heads
    assert stat.steady_peak_kv_tokens == [2 * steady] * 2


def test_the_report_judges_the_bound_on_the_steady_state_and_counts_the_prefill_transient_apart():
    from kvsieve.eval.report import bound_text, summarize, table_rows

    def row(method, sample, peak, steady=None):  # a 100-token prompt against a budget of 32, on 3 kv heads
        extra = {} if steady is None else {"steady_peak_kv_tokens": 3 * steady}
        return {"id": sample, "method": method, "budget": None if method == "full" else 32, "kv_heads": 3,
                "settings": {}, "prompt_tokens": 100, "generated_tokens": 50, "peak_kv_tokens": 3 * peak,
                "final_kv_tokens": 3 * 32, "compression_events": 5, "correct": True, **extra}

    rows = [row("full", "a", 150), row("full", "b", 150),
            row("tova", "a", 100, steady=33), row("tova", "b", 40, steady=40),  # the prompt: a transient only
            row("lazy", "a", 100, steady=49), row("lazy", "b", 100, steady=40),  # 49 > 1.5 x 32 after compressing
            row("h2o", "a", 100), row("h2o", "b", 40)]  # rows written before the steady peak: the whole peak
    summaries = {s.method: s for s in summarize(rows)}
    assert {m: bound_text(s) for m, s in summaries.items()} == {
        "full": "-", "tova": "ok (prefill 1/2)", "lazy": "OVER 1/2 (prefill 1/2)", "h2o": "OVER 1/2"}
    columns, cells = table_rows(list(summaries.values()))
    steady = {cell[0]: (cell[columns.index("peak live/head")], cell[columns.index("steady/head")]) for cell in cells}
    assert steady == {"full": ("150", "-"), "tova": ("70", "36"), "lazy": ("100", "44"), "h2o": ("70", "-")}
