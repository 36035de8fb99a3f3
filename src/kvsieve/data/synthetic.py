"""Generated data sets: passkey retrieval, needle in a haystack, and perplexity chunks of a text file.

Lengths are given in approximate tokens (``CHARS_PER_TOKEN`` characters of English each); the
runner records the real prompt length of every sample.

Sample ``i`` of ``passkey`` / ``needle`` is a function of ``i``, the seed and the data set's own
options only, never of how many samples are loaded: ``--limit N`` takes the first N of the
``count`` samples, as for file-based sets, so an id always names the same prompt.  Needle depths
cycle over ``DEPTHS`` (sample ``i`` at ``DEPTHS[i % 5]``), so any 5 consecutive samples cover
every depth.  A depth is the share of the filler placed before the needle, moved back to the
nearest sentence boundary: 0 puts the needle before the first sentence, 1 after the last.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from . import templates
from .records import DataError, read_text
from .sample import Sample

CHARS_PER_TOKEN = 4  # rough size of an English token, to turn --context-tokens into characters

_SUBJECTS = ("The committee", "A young engineer", "The old harbour", "Our neighbour", "The morning train",
             "A quiet library", "The river", "An orchestra", "The farmer", "A small bakery")
_VERBS = ("considered", "painted", "described", "repaired", "remembered", "visited", "measured", "ignored")
_OBJECTS = ("the northern bridge", "a forgotten letter", "the autumn fair", "three wooden boats",
            "the city walls", "a long winter", "the village clock", "an unusual map", "the garden path")
_ENDINGS = ("before sunset.", "with great care.", "for the second time.", "without a word.",
            "during the storm.", "as everyone expected.", "in the early spring.", "after a long debate.")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle depths, cycled over the samples

_KEYS = ("amber-falcon", "silent-river", "copper-lantern", "northern-willow", "velvet-harbor", "quiet-meadow",
         "crimson-atlas", "hollow-pine", "golden-orbit", "misty-canyon")


@dataclass
class RetrievalOptions:
    """Settings of passkey and needle samples.

    Parameters
    ----------
    count : int, default 20
        Number of samples in the data set (each depth of ``DEPTHS`` 4 times); ``--limit N``
        takes the first N of them and never changes a sample.
    context_tokens : int, default 2000
        Approximate context length in tokens.
    filler : str | None, default None
        Needle only: a local text file whose text forms the haystack (repeated as needed);
        default: generated sentences.
    """

    count: int = 20
    context_tokens: int = 2000
    filler: str | None = None

    def __post_init__(self):
        if self.count < 1 or self.context_tokens < 16:
            raise ValueError("need count >= 1 and context_tokens >= 16")


@dataclass
class TextOptions:
    """Perplexity chunks of a local text file (``--data PATH``).

    Parameters
    ----------
    chunk_tokens : int, default 1024
        Approximate length of each chunk in tokens; chunks do not overlap.
    """

    chunk_tokens: int = 1024

    def __post_init__(self):
        if self.chunk_tokens < 16:
            raise ValueError("chunk_tokens must be >= 16")


def _depth(index: int) -> float:
    return DEPTHS[index % len(DEPTHS)]


def _rng(name: str, seed: int, index: int) -> random.Random:
    """The random source of sample ``index`` alone (a str seed is hashed with SHA-512, stable
    across processes), so no sample depends on the others."""
    return random.Random(f"{name}:{seed}:{index}")


def _insert(filler: str, needle: str, depth: float) -> str:
    """Put ``needle`` at the last sentence boundary at or before ``depth`` of ``filler``
    (0 = before the first sentence, 1 = after the end of the filler)."""
    cut = int(len(filler) * depth)
    if cut >= len(filler):
        return f"{filler} {needle}".strip()
    boundary = filler.rfind(". ", 0, cut)
    cut = 0 if boundary < 0 else boundary + 2
    return f"{filler[:cut]}{needle} {filler[cut:]}".strip()


def _repeat(unit: str, chars: int) -> str:
    return " ".join([unit] * max(1, chars // (len(unit) + 1)))


def passkey(options: RetrievalOptions, seed: int) -> list[Sample]:
    """Passkey retrieval (Mohtashami & Jaggi 2023, arXiv:2305.16300): a 5-digit key hidden in
    repeated filler sentences, at a depth of ``DEPTHS`` (the paper draws the position at random)."""
    filler = _repeat(templates.PASSKEY_FILLER, options.context_tokens * CHARS_PER_TOKEN)
    samples = []
    for i in range(options.count):
        depth, rng = _depth(i), _rng("passkey", seed, i)
        key = str(rng.randint(10000, 99999))
        context = f"{templates.PASSKEY_INTRO} {_insert(filler, templates.PASSKEY_NEEDLE.format(key=key), depth)}"
        samples.append(Sample(str(i), templates.retrieval_prompt(context, templates.PASSKEY_QUESTION), key, "exact",
                              {"depth": round(depth, 4), "context_tokens": options.context_tokens}))
    return samples


def _generated_haystack(rng: random.Random, chars: int) -> str:
    sentences, size = [], 0
    while size < chars:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        sentences.append(s)
        size += len(s) + 1
    return " ".join(sentences)


def _file_haystack(path: str, chars: int) -> str:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"filler text file {file} does not exist")
    text = " ".join(read_text(file).split())
    if not text:
        raise DataError(f"filler text file {file} is empty")
    return (_repeat(text, chars) if len(text) < chars else text)[:chars]


def needle(options: RetrievalOptions, seed: int) -> list[Sample]:
    """Needle in a haystack with a numeric needle, RULER style (Hsieh et al. 2024, arXiv:2404.06654):
    "The special magic number for KEY is: N." hidden at a depth of ``DEPTHS``."""
    chars = options.context_tokens * CHARS_PER_TOKEN
    samples = []
    for i in range(options.count):
        depth, rng = _depth(i), _rng("needle", seed, i)
        haystack = _file_haystack(options.filler, chars) if options.filler else _generated_haystack(rng, chars)
        key, value = rng.choice(_KEYS), str(rng.randint(1_000_000, 9_999_999))
        context = _insert(haystack, templates.NEEDLE.format(key=key, value=value), depth)
        question = templates.NEEDLE_QUESTION.format(key=key)
        samples.append(Sample(str(i), templates.retrieval_prompt(context, question), value, "exact",
                              {"depth": round(depth, 4), "context_tokens": options.context_tokens, "key": key}))
    return samples


def text_chunks(path: str | None, options: TextOptions) -> list[Sample]:
    """Consecutive chunks of a local text file, cut at whitespace, for perplexity."""
    if path is None:
        raise DataError("the 'text' data set needs a local text file: pass --data PATH")
    file = Path(path)
    if not file.is_file():
        raise DataError(f"text file {file} does not exist")
    words = read_text(file).split()
    if not words:
        raise DataError(f"text file {file} is empty")
    limit, samples, chunk, size = options.chunk_tokens * CHARS_PER_TOKEN, [], [], 0
    for word in words:
        chunk.append(word)
        size += len(word) + 1
        if size >= limit:
            samples.append(" ".join(chunk))
            chunk, size = [], 0
    if chunk:
        samples.append(" ".join(chunk))
    return [Sample(str(i), [], "", "perplexity", {"text": t, "source": str(file)}) for i, t in enumerate(samples)]
