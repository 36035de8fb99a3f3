"""SkipKV adaptive steering (Sec. 4.2, Alg. 2) and batch grouping (Sec. 4.3, Eq. 12)."""

from __future__ import annotations

import pytest
import torch

from kvsieve import GenerateConfig, generate
from kvsieve.cache import DEAD_POS
from kvsieve.generate import encode_prompts
from kvsieve.methods import make_policy
from kvsieve.data.batching import group_by_prefill_length, padding_tokens
from kvsieve.methods._sentences import KEYWORDS, OthersCounter
from kvsieve.steering import Steering, SteeringVector, build_steering_vector, calibration_prompts, default_layer

END, KW = 0, 9  # delimiter and keyword ids in the hand-made tests
SHORT = "What is 7 times 8?"
MEDIUM = "Tell me a story about a fox and a heron."
RESPONSES = ["7 times 8 is 56.\nWait, let me check that again.\nSo 7 times 8 = 56.\n",
             "Once a fox met a heron.\nAlternatively, the heron met the fox.\nThey shared a meal.\n"]


def test_others_count_and_strength_schedule():
    counter = OthersCounter(torch.tensor([END]), torch.tensor([KW]))
    steering = Steering(vector=None, alpha0=1.25, gamma=0.02)
    rows = torch.arange(2)
    # prefill: row 0 closes an Others sentence and an execution one, then opens one holding a keyword;
    # row 1 is padded (its padding "keyword" does not count) and closes two execution sentences
    ids = torch.tensor([[5, KW, END, 6, END, KW], [KW, 5, END, 6, END, 7]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [DEAD_POS, 0, 1, 2, 3, 4]])
    counter.update(ids, pos, rows)
    assert counter.counts(rows).tolist() == [1, 0]
    counter.update(torch.tensor([[4], [KW]]), torch.tensor([[6], [5]]), rows)  # no sentence closes
    assert counter.counts(rows).tolist() == [1, 0]
    counter.update(torch.tensor([[END], [END]]), torch.tensor([[7], [6]]), rows)  # both close Others
    assert counter.counts(rows).tolist() == [2, 1]
    counter.update(torch.tensor([[END]]), torch.tensor([[7]]), torch.tensor([1]))  # row 0 finished
    assert counter.counts(rows).tolist() == [2, 1]  # a one-token sentence without keyword
    assert steering.strength(counter.counts(rows)).tolist() == pytest.approx([1.29, 1.27])  # Alg. 2 l. 27


@pytest.fixture(scope="module")
def vector(smollm):
    model, tok = smollm
    with pytest.warns(UserWarning, match=r"few sentences \(\{'E': 4, 'O': 2\}"):
        return build_steering_vector(model, tok, [SHORT, MEDIUM], responses=RESPONSES)


def test_calibration_prompts_take_a_slice_of_gsm8k_or_math_rows(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"question": "q0"}\n{"problem": "p1"}\n\n{"question": "q2"}\n{"answer": 3}\n')
    prompts = calibration_prompts(2, path, skip=1)
    assert [p[-1]["content"].split("Question: ")[-1] for p in prompts] == ["p1", "q2"]
    with pytest.raises(ValueError, match=r"mixed.jsonl:5: needs a 'question' or 'problem'"):
        calibration_prompts(4, path)
    short = tmp_path / "short.jsonl"
    short.write_text('{"question": "q0"}\n{"problem": "p1"}\n')
    with pytest.raises(ValueError, match="1 problems after skipping 1, 5 were asked for"):
        calibration_prompts(5, short, skip=1)


def test_vector_is_mean_execution_minus_mean_others(smollm, vector):
    model, tok = smollm
    layer = default_layer(30)
    assert vector.layer == layer == 21  # 20/28 of the depth (App. A.2), scaled to 30 layers
    reps = {"E": [], "O": []}
    with torch.inference_mode():
        for prompt, response in zip(encode_prompts(tok, [SHORT, MEDIUM], GenerateConfig()), RESPONSES):
            answer = tok(response, add_special_tokens=False).input_ids
            out = model(torch.tensor([prompt + answer]), output_hidden_states=True, use_cache=False)
            hidden, start = out.hidden_states[layer][0], len(prompt)  # input of decoder layer 21
            for i, t in enumerate(answer):
                if tok.decode([t]) == "\n":
                    words = tok.decode(answer[start - len(prompt): i + 1]).split()
                    kind = "O" if any(w.strip(",.") in KEYWORDS for w in words) else "E"
                    reps[kind].append(hidden[start: len(prompt) + i + 1].mean(0))
                    start = len(prompt) + i + 1
    assert (len(reps["E"]), len(reps["O"])) == (4, 2) == (vector.settings["execution_sentences"],
                                                         vector.settings["others_sentences"])
    want = torch.stack(reps["E"]).mean(0) - torch.stack(reps["O"]).mean(0)
    torch.testing.assert_close(vector.vector, want, rtol=1e-4, atol=1e-4)


def test_seal_labels_count_reflection_and_transition_phrases(smollm):
    """SEAL's classes (Sec. 4's definition): "verify" and "another way" make Others sentences that
    App. A.1's token keywords (Wait, Alternatively, again) leave as execution."""
    model, tok = smollm
    responses = ["7 times 8 is 56.\nLet me verify: 8 times 7 is 56.\nSo the answer is 56.\n",
                 "Once a fox met a heron.\nWait, the heron came first.\nAnother way to tell it: they met.\n"]
    counts = {}
    for labels in ("keywords", "seal"):
        with pytest.warns(UserWarning, match="few sentences"):
            vec = build_steering_vector(model, tok, [SHORT, MEDIUM], responses=responses, labels=labels)
        counts[labels] = (vec.settings["execution_sentences"], vec.settings["others_sentences"])
    assert counts == {"keywords": (5, 1), "seal": (3, 3)}
    assert "verify" in vec.settings["phrases"] and vec.settings["labels"] == "seal"
    with pytest.raises(ValueError, match="labels must be 'keywords'"):
        build_steering_vector(model, tok, [SHORT], responses=responses[:1], labels="sael")


def test_release_preset_needs_the_release_sign(vector):
    with pytest.raises(ValueError, match="others_minus_execution"):
        Steering.released(vector)
    flipped = SteeringVector(-vector.vector, vector.layer, vector.model_name, vector.fingerprint,
                             {**vector.settings, "direction": "others_minus_execution"})
    preset = Steering.released(flipped)
    assert (preset.alpha0, preset.gamma, preset.positions) == (-1.25, -0.02, "paragraph")
    # the same push as the paper's sign: alpha_t * V_release == |alpha_t| * V_paper
    torch.testing.assert_close(preset.strength(torch.tensor(3.0)) * flipped.vector,
                               Steering(vector, alpha0=1.25, gamma=0.02).strength(torch.tensor(3.0)) * vector.vector)


def test_saved_vector_round_trips_and_refuses_another_model(smollm, vector, tmp_path):
    model, _ = smollm
    vector.save(tmp_path / "v.pt")
    loaded = SteeringVector.load(tmp_path / "v.pt", model)
    assert torch.equal(loaded.vector, vector.vector) and loaded.layer == vector.layer
    other = SteeringVector(vector.vector, vector.layer, "other-model", {**vector.fingerprint, "hidden_size": 4096})
    other.save(tmp_path / "o.pt")
    with pytest.raises(ValueError, match="built for other-model"):
        SteeringVector.load(tmp_path / "o.pt", model)


def layer_input(model, layer, ids):
    """The hidden states entering decoder layer ``layer`` in a plain forward of ``ids``."""
    seen = []
    handle = model.get_decoder().layers[layer].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        model(ids, use_cache=False)
    finally:
        handle.remove()
    return seen[0]


@torch.inference_mode()
def test_injection_adds_exactly_alpha_t_times_v_at_the_chosen_layer(smollm, vector):
    model, tok = smollm
    steering = Steering(vector, alpha0=0.5, gamma=0.25)
    wait, newline = tok(" Wait", add_special_tokens=False).input_ids, tok("\n").input_ids
    first = torch.tensor([wait + newline + newline, [5, 6] + newline])  # row 0 closes an Others sentence
    ids = torch.tensor([[11, 12, 13], [14, 15, 16]])
    pos = torch.arange(3).expand(2, 3)
    plain = layer_input(model, vector.layer, ids)
    with steering.attach(model, tok) as on_tokens:
        on_tokens(first, pos, torch.arange(2))
        model(first, use_cache=False)
        on_tokens(ids, pos + 3, torch.arange(2))
        steered = layer_input(model, vector.layer, ids)
    alpha = torch.tensor([0.75, 0.5])  # alpha_0 + gamma * N_o, N_o = [1, 0]
    assert torch.equal(steered, plain + alpha[:, None, None] * vector.vector)
    assert not model.get_decoder().layers[vector.layer]._forward_pre_hooks  # removed on exit


def test_strength_zero_reproduces_unsteered_greedy_tokens(smollm, vector):
    model, tok = smollm
    config = GenerateConfig(max_new_tokens=16)
    plain = generate(model, tok, [SHORT, MEDIUM], config=config)
    zero = generate(model, tok, [SHORT, MEDIUM], config=config, hooks=[Steering(vector, alpha0=0.0, gamma=0.0)])
    assert zero.token_ids == plain.token_ids
    assert zero.settings["steering"]["layer"] == vector.layer
    strong = generate(model, tok, [SHORT, MEDIUM], config=config, hooks=[Steering(vector, alpha0=4.0)])
    assert strong.token_ids != plain.token_ids  # and a real strength does act


def test_batch_grouping_sorts_by_prefill_length_and_cuts_padding():
    lengths = [50, 12, 90, 30, 70, 14]
    batches = group_by_prefill_length(lengths, 2)
    assert batches == [[1, 5], [3, 0], [4, 2]]
    naive = [[0, 1], [2, 3], [4, 5]]
    assert padding_tokens(lengths, batches) == 2 + 20 + 20 < padding_tokens(lengths, naive) == 38 + 60 + 56
    with pytest.raises(ValueError):
        group_by_prefill_length(lengths, 0)


def test_grouping_changes_no_row_in_kvsieve(smollm):
    """kvsieve drops padding after prefill, so a row's budget and tokens do not depend on its batch."""
    model, tok = smollm
    config = GenerateConfig(max_new_tokens=20)
    prompts = [SHORT, "Tell me a long story about a fox, a heron, a crow and a wolf in a forest.", MEDIUM]
    policy = make_policy("skipkv", budget=44, interval=4)
    mixed = generate(model, tok, prompts[:2], policy, config)  # short with long: heavy padding
    lengths = [s.prompt_tokens for s in mixed.stats]
    grouped = generate(model, tok, [prompts[0], prompts[2]], policy, config)  # short with short
    assert lengths[1] - lengths[0] > grouped.stats[1].prompt_tokens - grouped.stats[0].prompt_tokens
    assert mixed.token_ids[0] == grouped.token_ids[0]
    assert mixed.stats[0].peak_kv_tokens == grouped.stats[0].peak_kv_tokens == [3 * (44 + 4)] * 30


def test_preset_follows_the_vectors_sign_and_takes_overrides():
    fingerprint = {"model_type": "llama", "hidden_size": 4, "num_hidden_layers": 2, "vocab_size": 10}
    paper = SteeringVector(torch.ones(4), 1, "m", fingerprint, {"direction": "execution_minus_others"})
    released = SteeringVector(-torch.ones(4), 1, "m", fingerprint, {"direction": "others_minus_execution"})
    assert Steering.preset(paper) == Steering(paper)  # alpha0 1, gamma 0.02, every position
    assert Steering.preset(released) == Steering.released(released)
    tuned = Steering.preset(paper, alpha0=1.25, positions="paragraph")
    assert (tuned.alpha0, tuned.gamma, tuned.positions) == (1.25, 0.02, "paragraph")
    with pytest.raises(ValueError, match=r"unknown steering setting\(s\) \['alpha'\]; allowed"):
        Steering.preset(paper, alpha=1.0)
    with pytest.raises(ValueError, match="positions must be"):
        Steering.preset(paper, positions="some")
    # settings name the vector by content: equal build settings, other values -> another digest
    assert Steering(paper).settings()["vector_sha256"] != Steering(released).settings()["vector_sha256"]


def test_read_names_the_fix_for_files_that_are_not_vectors(tmp_path):
    with pytest.raises(ValueError, match="does not exist; build one with: kvsieve steering build"):
        SteeringVector.read(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_text("not a tensor file")
    with pytest.raises(ValueError, match="is not a steering vector file"):
        SteeringVector.read(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a steering vector file .expected the fields"):
        SteeringVector.read(tmp_path / "other.pt")
