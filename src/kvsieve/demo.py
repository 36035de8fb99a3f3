"""The main job of ``make demo``: three grade-school word problems, full cache vs a few
eviction methods at a small budget, side by side.  Answers are graded by ``kvsieve.grading``'s
GSM8K grader, as in ``kvsieve eval``."""

from __future__ import annotations

PROBLEMS = [
    ("A box holds 6 eggs. How many eggs are in 2 boxes?", 12),
    ("Sara has 5 apples. She buys 3 more apples. How many apples does she have now?", 8),
    ("A pencil costs 2 dollars. How much do 4 pencils cost in dollars?", 8),
]

INSTRUCTION = "Solve the problem step by step, then give the final answer as a number after 'Answer:'.\n\n"

DEMO_METHODS = ("full", "streaming", "tova", "h2o", "rkv")
