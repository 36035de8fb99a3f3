"""Answer extraction and checking on the cases that trip graders up."""

import pytest

from kvsieve.grading import boxed_answers, final_answer, grade, key_answer, math_equal, to_number


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{42}.", ["42"]),
    ("\\boxed{\\frac{1}{2}} and \\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", ["\\frac{1}{2}", "\\left(3, \\frac{\\pi}{2}\\right)"]),
    ("\\boxed 7 is it", ["7"]),
    ("\\fbox{x^2}", ["x^2"]),
    ("no box", []),
    ("\\boxed{}", []),
    ("unbalanced \\boxed{3", []),  # cut off: 3 may be the start of 35
    ("is \\(\\boxed{8\\) miles from home", ["8"]),  # unclosed, but its math ends
    ("\\boxed{40 miles\nso the car", ["40 miles"]),  # unclosed, its line ends
])
def test_boxed_answers(text, expected):
    assert boxed_answers(text) == expected


@pytest.mark.parametrize("answer,expected", [
    ("1,234", 1234), ("$18.00", 18), ("\\$18", 18), ("18 dollars", 18), ("18 \\text{ dollars}", 18),
    ("5\\%", 5), ("-3.5", -3.5), ("1\\,000", 1000), ("12.", 12), ("\\frac{1}{2}", None), ("x+1", None),
])
def test_to_number(answer, expected):
    value = to_number(answer)
    assert (value is None if expected is None else float(value) == expected)


@pytest.mark.parametrize("text,reference,correct", [
    ("The answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", True),  # \dfrac vs \frac
    ("\\boxed{\\frac12}", "0.5", True),
    ("\\boxed{\\tfrac{3}{4}}", "\\frac{3}{4}", True),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
    ("\\boxed{33}", "033", True),  # AIME zero padding
    ("\\boxed{033}", "33", True),
    ("\\boxed{1,234}", "1234", True),  # comma in a number
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{90^\\circ}", "90^\\circ", True),
    ("\\boxed{5 \\text{ cm}}", "5", True),  # units
    ("first \\boxed{3}, on reflection \\boxed{5}", "5", True),  # several boxes: the last counts
    ("first \\boxed{3}, on reflection \\boxed{5}", "3", False),
    ("I could not finish.", "5", False),  # none
    ("Therefore, the final answer is 12.", "12", True),  # no box: the answer phrase
    ("x = 2 and then y = 7", "7", True),  # no box, no phrase: the last number
])
def test_grade_math(text, reference, correct):
    assert grade("math", text, reference).correct is correct


def test_no_answer_is_extracted_as_none():
    g = grade("math", "I am not sure.", "5")
    assert g.extracted is None and not g.correct


@pytest.mark.parametrize("text,reference,correct", [
    ("She makes 9 * 2 = 18 dollars.\n\\boxed{18}", "18", True),
    ("\\boxed{\\$18.00}", "18", True),
    ("\\boxed{1,080}", "1080", True),  # comma
    ("\\boxed{18 \\text{ dollars}}", "18", True),  # units
    ("\\boxed{18 eggs}", "18", True),
    ("\\boxed{x = 18}", "18", True),
    ("\\boxed{\\text{total} = 18 \\text{ eggs}}", "18", True),
    ("\\boxed{L - 8}", "8", False),  # the candle's new length, not "how much shorter"
    ("\\boxed{x = 2y + 8}", "8", False),
    ("\\boxed{\\frac{36}{2}}", "18", True),  # a fraction needs math-verify
    ("so 10 + 8 = 18\n#### 18", "18", True),  # GSM8K's own marker
    ("She pays 5 first and 20 in the end.", "20", True),  # the last number
    ("\\boxed{17} wait \\boxed{18}", "18", True),
    ("\\boxed{17} wait \\boxed{18}", "17", False),
    ("no numbers here", "18", False),
    ("\\boxed{18.5}", "18", False),
])
def test_grade_gsm8k(text, reference, correct):
    assert grade("gsm8k", text, reference).correct is correct


@pytest.mark.parametrize("text,reference,correct", [
    ("... so the answer is \\boxed{C}", "C", True),
    ("\\boxed{\\text{B}}", "B", True),
    ("\\boxed{(D)}", "D", True),
    ("\\boxed{A) 10^-9 eV}", "A", True),
    ("Reasoning...\nAnswer: B", "B", True),
    ("The correct option is (C).", "C", True),
    ("\\boxed{B}", "C", False),
    ("I cannot tell.", "A", False),
])
def test_grade_choice(text, reference, correct):
    assert grade("choice", text, reference).correct is correct


@pytest.mark.parametrize("text,reference,correct", [
    ("68392", "68392", True),
    ("The pass key is 68392.", "68392", True),
    ("\\boxed{68392}", "68392", True),
    ("68,392", "68392", True),
    ("6839", "68392", False),
    ("683921", "68392", False),  # exact, not a prefix
    ("I don't know", "68392", False),
])
def test_grade_exact(text, reference, correct):
    assert grade("exact", text, reference).correct is correct


def test_final_answer_prefers_the_last_box():
    assert final_answer("answer is 3. Then \\boxed{4}") == "4"


def test_math_equal_is_robust_to_garbage():
    assert not math_equal("\\frac{", "1")
    assert not math_equal("", "1")


def test_unknown_grader_names_the_choices():
    with pytest.raises(ValueError, match="math, gsm8k, choice, exact"):
        grade("bleu", "a", "b")


def test_choice_ignores_lowercase_words_after_answer():
    assert grade("choice", "The answer is a bit subtle, so Answer: D", "D").correct
    assert grade("choice", "the answer is a bit subtle", "A").extracted is None


# ---------------------------------------------------------------------------- variables are not units
@pytest.mark.parametrize("text,reference", [
    ("\\boxed{2x}", "2"), ("\\boxed{3i}", "3"), ("\\boxed{4 x y}", "4"),
    ("\\boxed{2}", "2k"),  # a MATH-500 reference with a variable
])
def test_math_letters_are_variables_not_units(text, reference):
    assert not grade("math", text, reference).correct


@pytest.mark.parametrize("text,reference", [
    ("\\boxed{\\dfrac{1}{2}}", "0.5"), ("\\boxed{033}", "33"), ("\\boxed{336^\\circ}", "336"),
    ("\\boxed{2k}", "2k"), ("\\boxed{5 \\text{ cm}}", "5"), ("\\boxed{1\\,000}", "1000"),
])
def test_math_still_equal(text, reference):
    assert grade("math", text, reference).correct


def test_to_number_without_units_reads_letters_as_no_number():
    assert to_number("2x", units=False) is None and to_number("18 dollars", units=False) is None
    assert to_number("$1,000", units=False) == 1000 and to_number("2x") == 2  # gsm8k: units


@pytest.mark.parametrize("text,reference", [
    ("\\boxed{18 dollars}", "18"), ("\\boxed{5 cm}", "5"), ("\\boxed{\\$1,000}", "1000"), ("It costs $1,000", "1000"),
])
def test_gsm8k_still_drops_units(text, reference):
    assert grade("gsm8k", text, reference).correct


# ---------------------------------------------------------------------------- truncated generations
CUT_OFF = "She has 10 apples and buys 8 more to get 18 total and then"


@pytest.mark.parametrize("kind", ["math", "gsm8k"])
def test_truncated_text_gets_no_credit_from_its_last_number(kind):
    assert grade(kind, CUT_OFF, "18").correct  # ended on its own: the last number is the answer
    g = grade(kind, CUT_OFF, "18", truncated=True)
    assert g.extracted is None and not g.correct


@pytest.mark.parametrize("kind,text", [
    ("math", "so \\boxed{18} and then I check that"),
    ("math", "Therefore, the answer is 18. Let me double check: 10 + 8"),
    ("gsm8k", "so \\boxed{18} and then I check that"),
    ("gsm8k", "10 + 8 = 18\n#### 18\nNow, another way to"),
    ("gsm8k", "The final answer is 18.\n\nTo verify, 10 + 8"),
])
def test_truncated_text_keeps_an_explicit_answer(kind, text):
    assert grade(kind, text, "18", truncated=True).correct


@pytest.mark.parametrize("kind,text", [
    ("math", "Thus the answer is 1"),  # maybe the start of 18
    ("gsm8k", "so 10 + 8 = 18\n#### 1"),
    ("gsm8k", "so \\boxed{1"),
])
def test_truncated_text_does_not_count_an_answer_it_ends_inside(kind, text):
    assert grade(kind, text, "1", truncated=True).extracted is None
    assert grade(kind, text, "1").correct  # the same text ended by eos has answered 1


@pytest.mark.parametrize("text,reference,explicit", [
    ("**Answer:** B\n\nbecause the", "B", True),
    ("Let me compare the options.\n**B**", "B", False),  # a final line: a fallback
    ("In 2 steps: the pass key is 71432. So", "71432", True),
    ("The key must be 71432 then", "71432", True),  # retrieval: the key appearing is the answer
    ("71432 71432 71432 7143", "71432", True),  # repeated until the limit
    ("I would guess 71432", "71432", False),  # a number the text ends inside (maybe 714321)
])
def test_truncated_choice_needs_an_explicit_answer_and_exact_the_key(text, reference, explicit):
    kind = "exact" if reference.isdigit() else "choice"
    assert grade(kind, text, reference).correct
    assert grade(kind, text, reference, truncated=True).correct is explicit


# ---------------------------------------------------------------------------- choice formats
@pytest.mark.parametrize("text,expected", [
    ("Reasoning...\n**Answer:** B", "B"),
    ("Comparing the options, only one fits.\n\n**B**", "B"),
    ("So the final answer:\n\n(B)", "B"),
    ("Answer: b", "B"),
    ("\\boxed{\\mathrm{B}}", "B"),
    ("\\boxed{\\text{(B)}}", "B"),
    ("Answer: I think B", "B"),  # "I" is no option
    ("Answer: B. On reflection, the answer is: C", "C"),  # the last marker
    ("The answer is C, not A.\nA bit more thought confirms it.", "C"),  # "A bit": no final-line letter
    ("A bit more thought is needed.", None),
    ("\\boxed{E}", None),  # A-D only
])
def test_choice_formats(text, expected):
    assert grade("choice", text, expected or "A").extracted == expected


# ---------------------------------------------------------------------------- passkey numbers
@pytest.mark.parametrize("text,reference,expected", [
    ("In 2 steps: the pass key is 71432", "71432", "71432"),
    ("The passkey is: 71432.", "71432", "71432"),
    ("The special magic number for quiet-lake is: 4821937.", "4821937", "4821937"),
    ("After 3 reads I found 71432, not 9.", "71432", "71432"),  # as many digits as the reference
    ("I counted 9 and then 12", "71432", "12"),  # else the last number
])
def test_key_answer(text, reference, expected):
    assert key_answer(text, reference) == expected


def test_exact_grades_the_pass_key_not_the_first_number():
    g = grade("exact", "In 2 steps: the pass key is 71432", "71432")
    assert g.extracted == "71432" and g.correct


# ---------------------------------------------------------------------------- an invented next turn (issue 51)
def test_a_box_inside_an_invented_next_turn_is_not_the_answer():
    # the shape of the grid's rows: the answer, then a made-up "Human:" turn the model answers itself
    text = ("So he makes 9 * 2 = \\boxed{18} dollars.Human: A certain number of students are in a class. "
            "How many?\n\nAssistant: There are \\boxed{30} students.")
    assert grade("gsm8k", text, "18").correct
    assert grade("gsm8k", text, "18").extracted == "18"
    assert not grade("gsm8k", text, "30").correct


def test_an_answer_cut_by_the_token_limit_inside_the_invented_turn_ended_at_the_turn():
    # the row ran to the limit only because it went on past its answer: graded as one that ended
    # there, so the fallback (the last number) counts
    text = "He has 17 + 5 * 6 = 47 sheep.Human: Now tell me how many goats"
    assert grade("gsm8k", text, "47", truncated=True).correct
    assert not grade("gsm8k", "He has 17 + 5 * 6 = 47 sheep and", "47", truncated=True).correct


def test_eval_stops_decoding_at_the_next_turn_markers():
    from kvsieve.eval.config import EvalConfig
    from kvsieve.grading import NEXT_TURN_MARKERS

    assert "Human:" in NEXT_TURN_MARKERS
    assert EvalConfig(model="smollm2-135m", dataset="gsm8k", out="unused").generate_config().stop_strings == NEXT_TURN_MARKERS
