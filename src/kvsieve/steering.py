"""SkipKV's adaptive steering: build the steering vector, and inject it while decoding.

Based on Tian et al., "SkipKV: Selective Skipping of KV Generation and Storage for Efficient
Inference with Large Reasoning Models" (arXiv:2512.07993); official code
github.com/TTTTTTris/SkipKV.

* **Sentences** (App. A.1): the delimiter set D and keyword set N, as token ids, and the count
  of Others sentences live in ``kvsieve.methods._sentences``, shared with SkipKV's scorer.
* **Steering vector** (Sec. 4.2, 5.1; SEAL's recipe): V = mean hidden state of execution
  sentences - mean hidden state of Others sentences, at the input of decoder layer ``layer``
  (``output_hidden_states[layer]`` in transformers' numbering), from the model's own greedy
  answers to calibration problems (``build_steering_vector``; kvsieve uses GSM8K *train*).
  Others sentences are labelled by App. A.1's keywords (default) or by SEAL's reflection and
  transition phrases (``labels="seal"``, the definition Sec. 4 follows).
* **Adaptive steering** (Alg. 2 lines 19, 26-27): H_k <- H_k + alpha_t V with, per row,
  alpha_t = alpha_0 + gamma * N_o, N_o the row's closed Others sentences so far (``Steering``,
  a ``policy.Hook`` for ``generate(..., hooks=[...])``).
* Batch grouping (Sec. 4.3, Eq. 12) is ``kvsieve.data.batching``; the command line that builds
  a vector is ``kvsieve steering build`` (``kvsieve.cli``).

Injection is a forward *pre*-hook on decoder layer ``layer``, registered by
``Steering.attach`` for one ``generate`` call and removed in its ``finally``.  Why a hook and
not a wrapper module: the hook changes only this model instance and only inside the ``with``;
it leaves the module tree (parameter names, ``layer_idx``, transformers' per-class output
recorders, accelerate's device hooks) untouched, whereas swapping ``layers[k]`` for a wrapper
renames parameters for the duration.  The pre-hook edits the layer's input, which is exactly
where the vector was measured, so build and injection use one tensor.  Nothing is global.

Usage::

    vec = build_steering_vector(model, tok, calibration_prompts(500))      # or SteeringVector.load
    out = kvsieve.generate(model, tok, prompts, policy, hooks=[Steering(vec, alpha0=1.0)])

Release preset (``RELEASED``): the official scripts build V = H_O - H_E and steer with
``coef = -1.25 - 0.02 * N_o`` (the same direction as the paper's +1.25 on E - O), only on
tokens containing "\\n\\n", only inside <think>, and update the strength every 128 tokens.
kvsieve's preset reproduces the sign, coefficients and "\\n\\n" positions; the <think> gate
and the 128-token strength update are not reproduced (the bundled models have no <think>).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, Sequence

import torch

from .cache import DEAD_POS
from .checks import check_fields
from .model_files import load_saved, save_file, model_fingerprint, model_name, other_model
from .methods._sentences import DELIMITERS, KEYWORDS, OthersCounter, sentence_spans, vocab_ids

PAPER_LAYER_FRACTION = 20 / 28  # App. A.2: layer 20 of R1-Qwen-7B's 28 (35/48 for 14B is 0.73)
MIN_SENTENCES = 20  # below this many sentences on either side, build_steering_vector warns (kvsieve's choice)
# SEAL's thought classes (Chen et al., 2025, arXiv:2504.07986, as its released classification step
# lists them): a paragraph whose lower-cased text contains a transition or a reflection phrase is a
# non-execution thought.  SkipKV Sec. 4 classifies "following the definition of" SEAL.
SEAL_PHRASES = ("alternatively", "think differently", "another way", "another approach", "another method",
                "another solution", "another strategy", "another technique",  # transition
                "wait", "verify", "make sure", "hold on", "think again", "'s correct", "'s incorrect",
                "let me check", "seems right")  # reflection
RELEASED = {"direction": "others_minus_execution", "alpha0": -1.25, "gamma": -0.02, "positions": "paragraph"}


# ---------------------------------------------------------------------------- the vector
@dataclass
class SteeringVector:
    """A steering direction measured at the input of decoder layer ``layer`` of one model."""

    vector: torch.Tensor  # [hidden_size], float32
    layer: int
    model_name: str
    fingerprint: dict
    settings: dict = field(default_factory=dict)

    def __post_init__(self):
        check_fields(self)
        if not isinstance(self.vector, torch.Tensor) or self.vector.ndim != 1 or not self.vector.is_floating_point():
            shape = tuple(self.vector.shape) if isinstance(self.vector, torch.Tensor) else type(self.vector).__name__
            raise ValueError(f"a steering vector is one row of floats [hidden_size], got {shape}")
        bad = int((~torch.isfinite(self.vector)).sum())
        if bad:
            raise ValueError(f"steering vector has {bad} of {self.vector.numel()} values that are not finite (nan "
                             "or inf); rebuild it (kvsieve steering build)")

    def fits(self, model) -> "SteeringVector":
        """Refuse a vector whose length is not ``model``'s hidden size or whose layer it lacks; returns ``self``."""
        config = model.config
        if self.vector.numel() != config.hidden_size:
            raise SteeringModelError(f"steering vector has {self.vector.numel()} values; the model's hidden size is "
                                     f"{config.hidden_size}")
        if not 0 <= self.layer < config.num_hidden_layers:
            raise SteeringModelError(f"steering layer {self.layer} is outside the model's layers "
                                     f"0..{config.num_hidden_layers - 1}")
        return self

    def save(self, path: str | Path) -> None:
        """Write the vector to ``path`` (``model_files.save_file``: a full disk is an ``OSError``)."""
        save_file({**asdict(self), "vector": self.vector.cpu()}, path)

    @classmethod
    def read(cls, path: str | Path) -> "SteeringVector":
        """The vector saved at ``path``, not yet checked against a model (``check``)."""
        hint = "build one with: kvsieve steering build --model MODEL --out FILE"
        data = load_saved(path, "steering vector", hint)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not {"vector", "layer", "model_name", "fingerprint"} <= set(data) <= names:
            raise ValueError(f"{path} is not a steering vector file (expected the fields {sorted(names)}); {hint}")
        return cls(**data)

    def check(self, model, source: str | Path = "") -> "SteeringVector":
        """Refuse a vector measured on another model (by name and shape); returns ``self``."""
        if other_model(self.model_name, self.fingerprint, model):
            raise self.built_for_another(model, source)
        return self.fits(model)

    def built_for_another(self, model, source: str | Path = "") -> "SteeringModelError":
        """The error for using this vector on ``model``, which it was not measured on."""
        where = f" {source}" if source else ""
        return SteeringModelError(f"steering vector{where} was {other_model(self.model_name, self.fingerprint, model)}; "
                                  "build one for this model (kvsieve steering build --model ...)")

    @classmethod
    def load(cls, path: str | Path, model) -> "SteeringVector":
        return cls.read(path).check(model, path)

    def digest(self) -> str:
        """Short sha256 of the vector's float32 values: tells two vectors with equal settings apart."""
        return hashlib.sha256(self.vector.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class SteeringModelError(ValueError):
    """A steering vector used with a model other than the one it was measured on."""


def default_layer(num_layers: int) -> int:
    """The paper's layer 20 of 28 (App. A.2), scaled by depth for other models."""
    return min(num_layers - 1, round(PAPER_LAYER_FRACTION * num_layers))


def _decoder_layer(model, layer: int):
    layers = model.get_decoder().layers
    if not 0 <= layer < len(layers):
        raise ValueError(f"steering layer {layer} is outside 0..{len(layers) - 1}")
    return layers[layer]


@contextlib.contextmanager
def _layer_input(model, layer: int, edit):
    """Forward pre-hook on decoder layer ``layer``: its input hidden states go through ``edit``."""

    def hook(module, args, kwargs):
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}

    handle = _decoder_layer(model, layer).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.inference_mode()
def build_steering_vector(model, tokenizer, prompts: Sequence, *, layer: int | None = None,
                          responses: Sequence[str] | None = None, max_new_tokens: int = 512,
                          representation: str = "mean", direction: str = "execution_minus_others",
                          keywords: Sequence[str] = KEYWORDS, delimiters: Sequence[str] = DELIMITERS,
                          labels: str = "keywords", dataset: str = "") -> SteeringVector:
    """V = mean(H_E) - mean(H_O) over the sentences of the model's answers (Sec. 4.2).

    ``responses`` (texts) skip generation; otherwise the model answers greedily with full KV.
    ``representation``: "mean" averages a sentence's token states (the paper: "average hidden
    states of ... thoughts"); "delimiter" takes the state of the delimiter token just before
    the sentence (SEAL-style, as public SEAL replications do).  ``direction`` flips the sign
    for the release preset.  ``labels`` says which sentences are Others: "keywords" (default)
    those holding a token of ``keywords``, App. A.1's set N, the labels decoding counts with;
    "seal" those whose lower-cased text contains one of SEAL's phrases (``SEAL_PHRASES``: "verify",
    "make sure", "another approach", ...), the classification SkipKV's Sec. 4 follows.  Offline
    only: this loops over samples in Python.
    """
    from .generate import GenerateConfig, encode_prompts, generate

    if representation not in ("mean", "delimiter") or direction not in ("execution_minus_others", "others_minus_execution"):
        raise ValueError("representation must be 'mean' or 'delimiter'; direction 'execution_minus_others' "
                         "or 'others_minus_execution'")
    if labels not in ("keywords", "seal"):
        raise ValueError(f"labels must be 'keywords' (App. A.1's set N) or 'seal' (SEAL's phrases), got {labels!r}")
    layer = default_layer(model.config.num_hidden_layers) if layer is None else layer
    _decoder_layer(model, layer)  # a layer the model lacks fails before any answer is generated
    config = GenerateConfig(max_new_tokens=max_new_tokens)
    encoded = encode_prompts(tokenizer, prompts, config)
    if responses is None:
        answers = generate(model, tokenizer, encoded, config=config).token_ids  # ids: encoded once
    else:
        answers = [tokenizer(r, add_special_tokens=False).input_ids for r in responses]
    delim = set(vocab_ids(tokenizer, delimiters).tolist())
    keyword = set(vocab_ids(tokenizer, keywords, strip=True).tolist())

    def is_others(sentence: list[int]) -> bool:
        if labels == "seal":
            text = tokenizer.decode(sentence).lower()
            return any(phrase in text for phrase in SEAL_PHRASES)
        return bool(keyword & set(sentence))

    groups: dict[str, list[torch.Tensor]] = {"E": [], "O": []}
    captured = []
    with _layer_input(model, layer, lambda h: captured.append(h[0].float()) or h):
        for prompt_ids, answer in zip(encoded, answers):
            captured.clear()
            model(input_ids=torch.tensor([prompt_ids + answer], device=model.device), use_cache=False)
            hidden, offset = captured[0], len(prompt_ids)  # [T, d]
            for start, end in sentence_spans(answer, delim):
                rep = (hidden[offset + start: offset + end + 1].mean(0) if representation == "mean"
                       else hidden[offset + start - 1])
                groups["O" if is_others(answer[start: end + 1]) else "E"].append(rep)
    if not groups["E"] or not groups["O"]:
        raise ValueError(f"found {len(groups['E'])} execution and {len(groups['O'])} Others sentences; "
                         "both are needed: use more samples or check the keyword set")
    few = {name: len(reps) for name, reps in groups.items() if len(reps) < MIN_SENTENCES}
    if few:
        warnings.warn(f"steering vector from few sentences ({few}; execution E, Others O): the mean of "
                      f"fewer than {MIN_SENTENCES} is noisy; use more --samples or harder problems", stacklevel=2)
    vector = torch.stack(groups["E"]).mean(0) - torch.stack(groups["O"]).mean(0)
    if direction == "others_minus_execution":
        vector = -vector
    settings = {"dataset": dataset, "samples": len(encoded), "representation": representation,
                "direction": direction, "labels": labels, "delimiters": list(delimiters),
                **({"phrases": list(SEAL_PHRASES)} if labels == "seal" else {"keywords": list(keywords)}),
                "execution_sentences": len(groups["E"]), "others_sentences": len(groups["O"])}
    return SteeringVector(vector.cpu(), layer, model_name(model), model_fingerprint(model), settings)


def calibration_prompts(n: int, path: str | Path = "../shared/data/gsm8k_train.jsonl", skip: int = 0) -> list[str]:
    """Rows ``skip`` .. ``skip + n - 1`` of a JSONL of problems (GSM8K's ``question`` or MATH's
    ``problem`` field) in kvsieve's math template.  Build from data never evaluated on: GSM8K
    *train* (the default), or a MATH-500 slice kept out of evaluation (e.g. ``skip=400``, with
    MATH-500 evaluations then limited to the first 400 problems)."""
    from .data.templates import math_prompt

    from .files import read_lines

    prompts = []
    for line_no, line in enumerate(read_lines(path), 1):
        if line_no <= skip or not line.strip():
            continue
        if len(prompts) == n:
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_no}: not a JSON line ({err.msg}); fix or remove that line") from None
        text = row.get("question", row.get("problem")) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{line_no}: needs a 'question' or 'problem' text field")
        prompts.append(math_prompt(text))
    if len(prompts) < n:
        raise ValueError(f"{path} has {len(prompts)} problems after skipping {skip}, {n} were asked for")
    return prompts


# ---------------------------------------------------------------------------- injection
@dataclass
class Steering:
    """Adaptive steering for one ``generate`` call (Sec. 4.2, Alg. 2 lines 19, 26-27), a
    ``policy.Hook``: ``generate(..., hooks=[Steering(vector)])``.

    Parameters
    ----------
    vector : SteeringVector
    alpha0 : float, default 1.0
        Initial strength alpha_0 (App. A.2: 1 or 1.25).
    gamma : float, default 0.02
        Increment per closed Others sentence (App. A.2).
    positions : str, default "all"
        "all": every token of every forward, prompt included (Alg. 2 line 19 runs each step);
        "paragraph": only tokens whose text contains "\\n\\n" (official code, SEAL-style).
    keywords, delimiters : tuple of str
        The sets N and D of App. A.1 that label Others sentences.  A keyword matches every token
        whose text, stripped, is the keyword (" Wait" and "Wait"); the official code takes the
        last token of encoding the bare word.

    ``Steering.released(vector)`` gives the official scripts' settings; it expects a vector built
    with ``direction="others_minus_execution"`` (their sign), on which alpha0 = -1.25 and
    gamma = -0.02 push the same way as the paper's +1.25 and +0.02 on E - O.
    """

    name: ClassVar[str] = "steering"  # its entry in generate's settings record (policy.Hook)
    vector: SteeringVector
    alpha0: float = 1.0
    gamma: float = 0.02
    positions: str = "all"
    keywords: tuple[str, ...] = KEYWORDS
    delimiters: tuple[str, ...] = DELIMITERS

    def __post_init__(self):
        check_fields(self)
        if self.positions not in ("all", "paragraph"):
            raise ValueError(f"steering positions must be 'all' or 'paragraph', got {self.positions!r}")

    @classmethod
    def released(cls, vector: SteeringVector) -> "Steering":
        if vector.settings.get("direction") != RELEASED["direction"]:
            raise ValueError("the release preset steers with negative strengths: build the vector with "
                             "direction='others_minus_execution' (kvsieve steering build --released)")
        return cls(vector, **{k: RELEASED[k] for k in ("alpha0", "gamma", "positions")})

    @classmethod
    def preset(cls, vector: SteeringVector, **overrides) -> "Steering":
        """The steering a saved vector implies, as the CLI applies it: the release preset for a vector
        built with ``--released`` (its sign needs it), the paper's defaults otherwise; ``overrides``
        (``alpha0``, ``gamma``, ``positions``) then replace single settings."""
        allowed = ("alpha0", "gamma", "positions")
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise ValueError(f"unknown steering setting(s) {unknown}; allowed: {list(allowed)}")
        base = cls.released(vector) if vector.settings.get("direction") == RELEASED["direction"] else cls(vector)
        return replace(base, **overrides)

    def strength(self, n_others: torch.Tensor) -> torch.Tensor:
        return self.alpha0 + self.gamma * n_others  # Alg. 2 line 27

    def settings(self) -> dict:
        return {"layer": self.vector.layer, "alpha0": self.alpha0, "gamma": self.gamma,
                "positions": self.positions, "vector_model": self.vector.model_name,
                "vector_sha256": self.vector.digest(), **self.vector.settings}

    @contextlib.contextmanager
    def attach(self, model, tokenizer):
        """Install the pre-hook for one call; yield the loop's ``on_tokens(ids, query_pos, rows)``."""
        if self.vector.fingerprint != model_fingerprint(model):
            raise self.vector.built_for_another(model)
        self.vector.fits(model)
        counter = OthersCounter(vocab_ids(tokenizer, self.delimiters).to(model.device),  # moved once, not per forward
                                vocab_ids(tokenizer, self.keywords, strip=True).to(model.device))
        paragraph = vocab_ids(tokenizer, ["\n\n"], contains=True).to(model.device)
        vec = self.vector.vector.to(model.device)
        pending: list[torch.Tensor] = []  # coefficients [B, T] for the next forward

        def on_tokens(token_ids, query_pos, rows):
            where = query_pos != DEAD_POS
            if self.positions == "paragraph":
                where &= torch.isin(token_ids, paragraph)
            # Alg. 2 runs lines 26-27 after the forward: this step's strength counts earlier sentences
            pending[:] = [self.strength(counter.counts(rows))[:, None] * where]  # [B, T]
            counter.update(token_ids, query_pos, rows)

        def edit(hidden):  # H_k <- H_k + alpha_t V  (Alg. 2 line 19)
            if not pending:
                raise RuntimeError("Steering.attach: call on_tokens(ids, query_pos, rows) before each forward")
            coef = pending.pop()
            return hidden + coef[..., None].to(hidden.dtype) * vec.to(hidden.dtype)

        with _layer_input(model, self.vector.layer, edit):
            yield on_tokens
