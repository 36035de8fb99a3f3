"""Answer extraction and checking.

One function per grader kind (``Sample.grader``), each ``(text, reference, *, truncated) -> Grade``:

* ``math``: the last ``\\boxed{}`` (else an "answer is ..." phrase, else the last number),
  compared with ``math-verify`` (LaTeX or plain, fractions, sets, intervals; AIME's zero padding
  ``033`` equals ``33``).  Letters are variables, not units: ``2x`` is not ``2`` and ``2`` is not
  ``2k``; only units inside ``\\text{}`` (``5 \\text{ cm}``) are dropped, by math-verify.
* ``gsm8k``: the same extraction (and GSM8K's own ``#### 18``), compared as numbers (commas,
  ``$``, unit words such as ``18 dollars`` and trailing periods dropped), with ``math-verify`` as
  a fallback for non-decimal forms such as ``\\frac{3}{2}``.
* ``choice``: an option letter (A-D), tried in order: the last box, the last explicit answer
  marker (``Answer: B``, ``**Answer:** B``, ``the correct option is (C)``), a final line holding
  the letter alone (``**B**``, ``(B)``).
* ``exact``: passkey / needle, a number equal to the reference exactly: the one after "pass key
  is" / "magic number is" / "the number is", else one with as many digits as the reference,
  else the last number.  A truncated answer keeps the first two (a key repeated until the token
  limit has been retrieved), minus a number the text ends inside.

Several boxed answers: the last one counts (the model's final word).  No answer: ``extracted``
is None and the grade is wrong.

Truncated generations (``truncated=True``: the generation hit the token limit): a model cut off
mid-reasoning has not answered, so only an explicit answer counts (a box, an answer phrase,
``####``, an answer marker), never a fallback (the last number, a final line); and not an
answer the text ends inside (``the answer is 1`` may be the start of ``18``, as ``\\boxed{1``
may).  ``exact`` is the exception noted above.
Texts that ended on their own (eos, a stop string) keep the fallbacks.

A made-up next turn ends the answer: some models, done answering, go on with an invented dialogue
(``...\\boxed{11.50}.Human: A certain number of students...``), and a box inside that turn is not the
answer.  ``grade`` cuts the text at the first ``NEXT_TURN_MARKERS`` and grades what comes before as
an answer that ended on its own; ``kvsieve eval`` also stops decoding there (``stop_strings``), as
lm-evaluation-harness stops at its ``until`` strings.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable


@dataclass(frozen=True)
class Grade:
    extracted: str | None
    correct: bool


# ---------------------------------------------------------------------------- extraction
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_PHRASE = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:)\s*[:\s]*\$?\s*(?P<ans>[^\n$]+?)\s*\$?\s*(?:\.\s|\.?$|\n)",
    re.IGNORECASE | re.MULTILINE)
_UNCLOSED_END = re.compile(r"\\\)|\\\]|\$|\n")
_HASHES = re.compile(r"####\s*(?P<ans>[^\n]+)")  # GSM8K's own answer line
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def boxed_answers(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces) and ``\\boxed 5``, in order.

    A box whose brace never closes (``\\(\\boxed{8\\) miles``, common once a cache has been
    compressed hard) holds what follows it up to the end of its math (``\\)``, ``\\]``, ``$``) or
    line; one the text ends inside (``\\boxed{3`` cut off at the token limit) holds nothing.
    """
    found = []
    for match in _BOX.finditer(text):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for end in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    found.append(text[start + 1:end].strip())
                    break
            else:  # unclosed: only a box its math or line closes, never one the text cuts off
                stop = _UNCLOSED_END.search(text, start + 1)
                if stop:
                    found.append(text[start + 1:stop.start()].strip())
        else:  # "\boxed 5": up to the next space or dollar sign
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                found.append(token.group(0))
    return [f for f in found if f]


def marked_answers(pattern: re.Pattern, text: str, truncated: bool = False) -> list[str]:
    """The ``ans`` group of every match of ``pattern`` in ``text``, in order; for a ``truncated``
    text, not one the text ends inside (``the answer is 1`` cut off may be the start of 18)."""
    return [m.group("ans").strip() for m in pattern.finditer(text)
            if not (truncated and m.end("ans") == len(text))]


def final_answer(text: str, truncated: bool = False) -> str | None:
    """The last boxed answer, else the last "answer is X" / "Answer: X" phrase, else None."""
    boxed = boxed_answers(text)
    if boxed:
        return boxed[-1]
    phrases = marked_answers(_ANSWER_PHRASE, text, truncated)
    return phrases[-1] if phrases else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234`` ``-3.5``), else None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def unmarked_answer(text: str, truncated: bool = False) -> str | None:
    """The answer of a text with no explicit one: its last number, unless it was ``truncated``
    (a model cut off mid-reasoning has not answered; its last number is where it stopped)."""
    return None if truncated else last_number(text)


# ---------------------------------------------------------------------------- numbers
def to_number(answer: str, units: bool = True) -> Fraction | None:
    """A plain decimal answer as an exact fraction (``1,234`` ``$18.00`` ``5\\%``), else None.

    With ``units`` (GSM8K), trailing words are dropped as units (``18 dollars``, ``5 cm``); without
    (MATH), letters are variables and ``2x`` is no number.
    """
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^}]*)\}", r" \1 ", answer)  # unwrap \text{...}
    s = re.sub(r"\\[$%]|[$%]|\\[,;!: ]|\{,\}", lambda m: "" if m.group(0) != "{,}" else ",", s)
    s = _THOUSANDS.sub("", s).strip().rstrip(".")
    if units:
        s = re.sub(r"(?:\s*[a-zA-Z]+\.?)+$", "", s)  # trailing unit words
    s = s.strip()
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return None
    return Fraction(s)


# ---------------------------------------------------------------------------- math-verify
def _timeout() -> int | None:
    """math-verify's timeouts use SIGALRM, which works only in the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equal(candidate: str, reference: str) -> bool:
    """Is ``candidate`` the same mathematical answer as ``reference``? (math-verify, plain numbers first;
    letters are variables, so ``2x`` is not ``2``)."""
    if candidate.strip() == reference.strip():
        return True
    a, b = to_number(candidate, units=False), to_number(reference, units=False)
    if a is not None and b is not None:
        return a == b
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    timeout = _timeout()
    gold = parse(f"${reference}$", configs, parsing_timeout=timeout)
    pred = parse(f"${candidate}$", configs, parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


# ---------------------------------------------------------------------------- graders
def grade_math(text: str, reference: str, *, truncated: bool = False) -> Grade:
    """MATH / AIME: the final answer (box, phrase, else the last number) against ``reference`` (``math_equal``)."""
    answer = final_answer(text, truncated) or unmarked_answer(text, truncated)
    return Grade(answer, answer is not None and math_equal(answer, reference))


def grade_gsm8k(text: str, reference: str, *, truncated: bool = False) -> Grade:
    """GSM8K: the box, ``####``, phrase, else the last number, read as a number (units dropped)."""
    boxed = boxed_answers(text)
    hashes = marked_answers(_HASHES, text, truncated)
    answer = (boxed[-1] if boxed else hashes[-1] if hashes
              else final_answer(text, truncated) or unmarked_answer(text, truncated))
    if answer is None:
        return Grade(None, False)
    number, ref = to_number(answer), to_number(reference)
    equation = re.fullmatch(r"[^=]*=\s*([^=]+)", answer)  # "x = 18": the right-hand side
    if number is None and equation and not re.search(r"\\frac|/", equation.group(1)):
        number = to_number(equation.group(1))  # an expression such as "L - 8" stays unread: not 8
    if number is not None and ref is not None:
        return Grade(answer, number == ref)
    return Grade(answer, math_equal(answer, reference))


OPTION_LETTERS = "ABCD"  # GPQA's four; a grader is not told a sample's option count
_LATEX_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")  # \text{(B)} -> (B)
_LONE_LETTER = re.compile(rf"[\W_]*([{OPTION_LETTERS}])[\W_]*", re.IGNORECASE)  # "b", "**B**", "(B)."
_CAPITAL_LETTER = re.compile(rf"(?<![A-Za-z\\])([{OPTION_LETTERS}])(?![A-Za-z])")  # "I think B": B
_ANSWER_MARKER = re.compile(r"\b(?:answer|option|choice)\**\s*(?:is\b|:)[\s:*]*(?=(?P<ans>[^\n]*))",
                            re.IGNORECASE)  # "Answer: B", "**Answer:** B", "the correct option is (C)"


def option_letter(snippet: str) -> str | None:
    """The option letter ``snippet`` names: the snippet is the letter alone (any case, up to
    brackets, bold and a period), else its first capital option letter standing alone."""
    snippet = _LATEX_WRAPPER.sub(r"\1", snippet)
    match = _LONE_LETTER.fullmatch(snippet) or _CAPITAL_LETTER.search(snippet)
    return match.group(1).upper() if match else None


def choice_answer(text: str, truncated: bool = False) -> str | None:
    """The option letter of ``text``: from the last box, else the last answer marker that names
    one, else (unless ``truncated``) a final line holding the letter alone (``**B**``, ``(B)``)."""
    boxed = boxed_answers(text)
    explicit = boxed[-1:] + marked_answers(_ANSWER_MARKER, text, truncated)[::-1]
    letter = next(filter(None, map(option_letter, explicit)), None)
    if letter is None and not truncated and text.strip():
        lone = _LONE_LETTER.fullmatch(text.strip().splitlines()[-1])
        letter = lone.group(1).upper() if lone else None
    return letter


def grade_choice(text: str, reference: str, *, truncated: bool = False) -> Grade:
    """Multiple choice: ``choice_answer``'s letter against the reference letter."""
    letter = choice_answer(text, truncated)
    return Grade(letter, letter is not None and letter == reference.strip().upper())


_KEY_PHRASE = re.compile(
    r"(?:pass[\s-]?key|(?:magic|the) number)(?:\s+for\s+[^\n]*?)?\s+is\b[\s:*$]*(?P<ans>\d+)",
    re.IGNORECASE)  # "the pass key is 71432", "the magic number for X is: 123"


def key_answer(text: str, reference: str, truncated: bool = False) -> str | None:
    """The number a passkey / needle answer gives: the last after "pass key is" (and the like),
    else the last with as many digits as ``reference``, else (unless ``truncated``) the last.

    A key repeated until the token limit (``71432 71432 7143``) still answers: retrieval is
    graded on the key appearing, so only a number the truncated text ends inside is dropped."""
    text = _THOUSANDS.sub("", text)
    phrased = marked_answers(_KEY_PHRASE, text, truncated)
    numbers = [m.group() for m in re.finditer(r"\d+", text) if not (truncated and m.end() == len(text))]
    sized = [n for n in numbers if len(n) == len(reference.strip())]
    for found in [phrased, sized] if truncated else [phrased, sized, numbers]:
        if found:
            return found[-1]
    return None


def grade_exact(text: str, reference: str, *, truncated: bool = False) -> Grade:
    """Passkey / needle: ``key_answer`` of the last box (else the whole text) equals ``reference``."""
    boxed = boxed_answers(text)
    source = boxed[-1] if boxed else text
    if not re.search(r"\d", source):  # no number at all: what the model said, for the record
        answer = source.strip() or None
    else:
        answer = key_answer(source, reference, truncated and not boxed)  # a box is explicit
    return Grade(answer, answer is not None and answer == reference.strip())


GRADERS: dict[str, Callable[..., Grade]] = {
    "math": grade_math,
    "gsm8k": grade_gsm8k,
    "choice": grade_choice,
    "exact": grade_exact,
}


# The start of an invented next turn: the plain-text dialogue format the Qwen2.5 models fall into after an
# answer (the only marker found in the grid's 2,650 rows: 355 rows, 2026-11-27), and the chat template's
# own turn opener, should a decode keep special tokens
NEXT_TURN_MARKERS = ("Human:", "<|im_start|>")


def cut_at_next_turn(text: str) -> tuple[str, bool]:
    """``text`` up to the first ``NEXT_TURN_MARKERS``, and whether one was found."""
    cut = min((i for i in (text.find(m) for m in NEXT_TURN_MARKERS) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def grade(kind: str, text: str, reference: str, *, truncated: bool = False) -> Grade:
    """Grade ``text`` against ``reference`` with the grader ``kind`` (a ``Sample.grader``);
    ``truncated``: the generation hit the token limit, so only an explicit answer counts.  A text
    that goes on into an invented next turn is graded up to it, as an answer that ended there."""
    if kind not in GRADERS:
        raise ValueError(f"no answer grader for {kind!r}; graders: {', '.join(GRADERS)}")
    text, ended = cut_at_next_turn(text)
    return GRADERS[kind](text, reference, truncated=truncated and not ended)
