"""Answer extraction and checking.

One function per grader kind (``Sample.grader``), each ``(text, reference) -> Grade``:

* ``math``: the last ``\\boxed{}`` (else an "answer is ..." phrase, else the last number),
  compared with ``math-verify`` (LaTeX or plain, fractions, sets, intervals; AIME's zero padding
  ``033`` equals ``33``).
* ``gsm8k``: the same extraction, compared as numbers (commas, ``$``, units and trailing
  periods dropped), with ``math-verify`` as a fallback for non-decimal forms such as ``\\frac{3}{2}``.
* ``choice``: an option letter, from the box or a final "Answer: X" line.
* ``exact``: passkey / needle, the first number of the answer equals the reference exactly.

Several boxed answers: the last one counts (the model's final word).  No answer: ``extracted``
is None and the grade is wrong.
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


def final_answer(text: str) -> str | None:
    """The last boxed answer, else the last "answer is X" / "Answer: X" phrase, else None."""
    boxed = boxed_answers(text)
    if boxed:
        return boxed[-1]
    phrases = [m.group("ans").strip() for m in _ANSWER_PHRASE.finditer(text)]
    return phrases[-1] if phrases else None


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------------------- numbers
def to_number(answer: str) -> Fraction | None:
    """A plain decimal answer as an exact fraction (``1,234`` ``$18.00`` ``18 dollars`` ``5\\%``), else None."""
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^}]*)\}", r" \1 ", answer)  # unwrap \text{...}
    s = re.sub(r"\\[$%]|[$%]|\\[,;!: ]|\{,\}", lambda m: "" if m.group(0) != "{,}" else ",", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators
    s = re.sub(r"(?:\s*[a-zA-Z]+\.?)+$", "", s.strip().rstrip(".")).strip()  # trailing unit words
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return None
    return Fraction(s)


# ---------------------------------------------------------------------------- math-verify
def _timeout() -> int | None:
    """math-verify's timeouts use SIGALRM, which works only in the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equal(candidate: str, reference: str) -> bool:
    """Is ``candidate`` the same mathematical answer as ``reference``? (math-verify, numbers first)."""
    if candidate.strip() == reference.strip():
        return True
    a, b = to_number(candidate), to_number(reference)
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
def grade_math(text: str, reference: str) -> Grade:
    answer = final_answer(text) or last_number(text)
    return Grade(answer, answer is not None and math_equal(answer, reference))


def grade_gsm8k(text: str, reference: str) -> Grade:
    boxed = boxed_answers(text)
    hashes = re.findall(r"####\s*([^\n]+)", text)
    answer = boxed[-1] if boxed else hashes[-1].strip() if hashes else final_answer(text) or last_number(text)
    if answer is None:
        return Grade(None, False)
    number, ref = to_number(answer), to_number(reference)
    equation = re.fullmatch(r"[^=]*=\s*([^=]+)", answer)  # "x = 18": the right-hand side
    if number is None and equation and not re.search(r"\\frac|/", equation.group(1)):
        number = to_number(equation.group(1))  # an expression such as "L - 8" stays unread: not 8
    if number is not None and ref is not None:
        return Grade(answer, number == ref)
    return Grade(answer, math_equal(answer, reference))


_LETTER_IN_BOX = re.compile(r"^\(?\s*(?:\\text(?:bf)?\{\s*)?\(?([A-Z])\)?\s*\}?\s*\)?(?:[\s:.)].*)?$", re.DOTALL)
_LETTER_LINE = re.compile(r"(?i:answer|option|choice)\s*(?i:is)?\s*[:\s]\s*\**\(?([A-Z])\b\)?")  # letter: capital


def grade_choice(text: str, reference: str) -> Grade:
    letter = None
    boxed = boxed_answers(text)
    if boxed:
        match = _LETTER_IN_BOX.match(boxed[-1])
        letter = match.group(1) if match else None
    if letter is None:
        lines = _LETTER_LINE.findall(text)
        letter = lines[-1] if lines else None
    return Grade(letter, letter is not None and letter == reference.strip().upper())


def grade_exact(text: str, reference: str) -> Grade:
    boxed = boxed_answers(text)
    source = boxed[-1] if boxed else text
    numbers = re.findall(r"\d+", source.replace(",", ""))
    answer = numbers[0] if numbers else (source.strip() or None)
    return Grade(answer, answer is not None and answer == reference.strip())


GRADERS: dict[str, Callable[[str, str], Grade]] = {
    "math": grade_math,
    "gsm8k": grade_gsm8k,
    "choice": grade_choice,
    "exact": grade_exact,
}


def grade(kind: str, text: str, reference: str) -> Grade:
    """Grade ``text`` against ``reference`` with the grader ``kind`` (a ``Sample.grader``)."""
    if kind not in GRADERS:
        raise ValueError(f"no answer grader for {kind!r}; graders: {', '.join(GRADERS)}")
    return GRADERS[kind](text, reference)
