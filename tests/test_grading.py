"""Answer extraction and checking on the cases that trip graders up."""

import pytest

from kvsieve.grading import boxed_answers, final_answer, grade, math_equal, to_number


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
