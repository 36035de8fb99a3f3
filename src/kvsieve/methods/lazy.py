"""LazyEviction: lagged eviction that keeps tokens whose attention recurs.

arXiv:2506.15969; official code: github.com/Halo-949/LazyEviction.

Based on "LazyEviction: Lagged KV Eviction with Attention Pattern Observation for Efficient
Long Reasoning" (ACL submission, Sec. 4, Algorithm 1, App. A-D, H).  Every decoding step each
cached token's TS and MRI are updated from the current query's attention (Alg. 1 lines 1-6,
Eq. 1; see ``_timestamps`` for the clock, the GQA reduction and the initial values).  Every W
decode steps, and only while the cache holds more than B tokens, the W newest tokens are kept
plus the B - W with the highest importance I_t (Eqs. 2, 5); the cache peaks at B + W (Fig. 6).

On the engine: ``interval = W, recent = W, budget = B``, the defaults derived from ``window``
(Alg. 1 line 8's ``B >= |K|`` is a typo for ``|K| > B``, the engine's ``should_compress``).
The interval is W at every budget: below B = 2W, where kvsieve's cap of a default interval at
``budget // 2`` would part it from W, the policy is refused (``LazyEviction.window_interval``).
The prompt is not compressed at prefill (``compress_prefill`` defaults to False): Alg. 1 line 8
evicts only "at the decoding step t = kW" (k in N+, App. B), none at the prefill.  Its tokens
are scored like generated ones (App. H.2).  Their queries are not tracking steps
(``observe_prompt=False``): Alg. 1's step t is a decoding step.  So the prompt enters the cache
in one step, the prefill (decoding step 0), and every prompt token is born there with MRI 0
(``prompt_birth="prefill"``), as a generated token is born at the step that appends it.

Baselines of the paper's comparison.  Its H2O keeps W recent tokens, W being LazyEviction's
window ("the number of recent tokens in H2O is equal to LazyEviction's window size", App. C),
and evicts every step: ``make_policy("h2o", budget=B, recent_rule="lazy-window")`` for the
default W (``recent=W`` for another; ``h2o``'s own default, ``recent = B // 2``, is not that
baseline).  Table 3's "+ window" rows use the observation-window schedule, evicting every W
steps with the same window: ``make_policy("h2o", budget=B, interval=W, recent=W)``, likewise
for ``tova`` and ``raas``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import torch

from ..checks import SettingError
from ..policy import About, Defaults, Needs, Scorer, check_choice, register
from ._common import HEAD_REDUCTIONS, LAZY_WINDOW
from ._timestamps import (MODEL_FAMILY, TS_UNSET, alpha_for_call, born_timestamps, observe_timestamps,
                          prefill_timestamps, resolve_alpha, threshold)

# W, the observation window: the paper's value for GSM8K (Table 3; best of Table 9 on DS-Llama-8B),
# kept in ``_common`` because it is also the recent window of the paper's H2O baseline (App. C).
DEFAULT_WINDOW = LAZY_WINDOW

H2_FORMS = ("text", "printed", "scaled")
PROMPT_BIRTHS = ("prefill", "position")
# Names before issue 28, refused with a pointer: "decreasing" (then the default) is kvsieve's own
# form, not a reading of the paper; "steep" was the smallest change the text asks for, now "text".
_RENAMED_H2 = {"decreasing": "scaled", "steep": "text"}


def h1_score(idle: torch.Tensor, mri: torch.Tensor) -> torch.Tensor:
    """H1 = 2 sigma(-(t - TS) / MRI) (Sec. 4); ``idle`` is t - TS >= 0.

    Undefined at MRI 0 as printed; MRI 0 takes the limit MRI -> 0+: 1 for a token activated
    at step t (idle 0), else 0 (never re-activated since its birth).
    """
    # deviation: MRI 0 (printed: division by zero) -> the limit MRI -> 0+
    ratio = torch.where(mri > 0, idle / mri.clamp(min=1), torch.where(idle > 0, float("inf"), 0.0))
    return 2 * torch.sigmoid(-ratio)


def h2_score(mri: torch.Tensor, form: str = "text") -> torch.Tensor:
    """H2, the recurrence-frequency term of Eq. (2); 0 at MRI 0 in every form (Sec. 4: "if
    MRI = 0 ... H2 = 0").  MRI counts steps, so it is 0 or at least 1.

    Sec. 4 prints H2 = 2 sigma(-1/(MRI - 1)), which *rises* with MRI (from 0 at MRI -> 1+ to 1)
    and is undefined at MRI 1, while its words, "tokens with smaller MRI values have a higher
    possibility to be important ... H2-Score prioritizes tokens with smaller MRI values", and
    App. D's two properties of the score functions, "(1) monotonically decreasing" and "(2) ...
    within the range of [0, 1]", want it to fall.  The forms:

    "text" (default): 2 sigma(-(MRI - 1)), the printed formula with the reciprocal dropped.  The
        smallest change of the printed formula that satisfies the words and App. D: it falls
        from 1 at MRI 1 (recurring every step) towards 0, stays in [0, 1] and is defined at
        MRI 1.  (Flipping only the sign, 2 sigma(1/(MRI - 1)), also falls, but lies in (1, 2),
        against App. D's range, and stays undefined at MRI 1.)  It is near 0 beyond MRI ~8.
    "printed": 2 sigma(-1/(MRI - 1)) as printed, rising; MRI 1 takes the limit MRI -> 1+, 0.
    "scaled": 2 sigma(-(MRI - 1)/MRI), kvsieve's own decreasing form, not in the paper: 1 at
        MRI 1, falling only to 2 sigma(-1) = 0.54, so it still ranks MRIs of tens to hundreds
        (Fig. 3c); kvsieve's default before issue 28 (then called "decreasing").
    """
    m = mri.clamp(min=1)
    if form == "text":  # deviation: the printed H2 rises with MRI; Sec. 4's words and App. D say it falls
        arg = -(m - 1)
    elif form == "printed":
        arg = -1 / (m - 1)  # -inf at MRI 1
    elif form == "scaled":  # kvsieve's own form
        arg = -(m - 1) / m
    else:
        raise ValueError(f"unknown H2 form {form!r}; use one of {list(H2_FORMS)}{_renamed_hint(form)}")
    return torch.where(mri > 0, 2 * torch.sigmoid(arg), 0.0)


def _renamed_hint(form) -> str:
    return f" ({form!r} is now {_RENAMED_H2[form]!r})" if form in _RENAMED_H2 else ""


def importance(idle: torch.Tensor, mri: torch.Tensor, form: str = "text") -> torch.Tensor:
    """I_t, Eq. (2): H1 + H2 where MRI != 0, H1 alone where MRI = 0."""
    h1 = h1_score(idle, mri)
    return torch.where(mri != 0, h1 + h2_score(mri, form), h1)


def read_window(path: str) -> int:
    """W saved by ``kvsieve analyze mri`` (its ``recommended_window``, the 80% MRI threshold)."""
    from ..files import read_text

    try:
        return int(json.loads(read_text(path))["recommended_window"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"lazy window='auto' reads 'recommended_window' from {path!r}, written by "
                         f"`kvsieve analyze mri --out {path}`; run it first or set an integer window ({err!r})") from None


@register("lazy")
@dataclass
class LazyEviction(Scorer):
    """MRI-centric importance with lagged eviction.

    Parameters
    ----------
    window : int | str, default 25
        W, the eviction interval and the protected recent window (Sec. 4).  25 is the paper's
        W for GSM8K (Table 3; best of Table 9, DS-Llama-8B).  App. C sets W to the 80th
        percentile of MRI: ``"auto"`` reads it from ``analysis``.  The policy's interval and
        recent window default to W; its budget must be at least 2W (``window_interval``).  The
        paper's H2O baseline keeps the same W recent tokens (App. C): ``make_policy("h2o",
        budget=B, recent_rule="lazy-window")`` for the default W, ``recent=W`` for another.
    alpha : float | None, default None
        Activation threshold (Alg. 1 line 2).  None: the Table 10 value for ``family``.
    family : str, default "auto"
        Model family for alpha: "llama" 5e-4 (DS-Llama-8B), "qwen2"/"qwen3" 1e-4 (DS-Qwen-7B,
        Qwen3-4B, QwQ-32B), App. C.  For other models of a family (SmolLM2 is "llama",
        Qwen2.5-Coder "qwen2") and for "mistral" (5e-4) the value is an extrapolation.
        "auto" (default): the model's own family, its ``config.model_type``, read at each
        generate call (``attach``), as App. C sets alpha per model; a model type without a
        Table 10 value is refused, naming ``family`` and ``alpha``.  (Before issue 35's review
        the default was "qwen2" for every model: 1e-4 on Llama-family models too.)
    head_reduction : str, default "mean"
        Reduction of a GQA group's attention onto its kv head ("mean", "max", "sum"); not
        fixed by the paper.  alpha assumes one softmax row's scale, which "mean" keeps.
    h2 : str, default "text"
        H2 form (see ``h2_score``): "text", the paper's words (Sec. 4: smaller MRI, higher H2;
        App. D: decreasing, in [0, 1]) by the smallest change of its printed formula, which
        rises with MRI instead; "printed", the formula as printed; "scaled", kvsieve's own
        decreasing form (the default before issue 28).
    observe_prompt : bool, default False
        Whether the prompt's queries count as tracking steps.  False (the paper): Alg. 1 runs
        lines 1-6 at each step t of its input, a decoding step ("its latest timestamp is
        updated to the value of current decoding step t ... during the whole decoding phase",
        Sec. 4, Recurrence Interval Tracking; App. B; App. E.2 charges the tracking to decode
        steps), so prompt tokens keep their birth TS (``prompt_birth``) and MRI 0 until decoding
        starts (the engine's multi-query calls are not observed; a prefill chunk of one token
        would be).
        True: every prompt query is a step as well (kvsieve's default before issue 28).
    prompt_birth : str, default "prefill"
        The TS a prompt token starts decoding with when the prompt's queries are not steps
        (``observe_prompt=False``), so the MRI its first activation records; the paper does not
        say.  "prefill": every prompt token is born at the prefill, decoding step 0 (on
        kvsieve's clock the prompt's last position): a first activation at decoding step t
        records MRI t.  It keeps TS on Alg. 1's clock, which only has decoding steps ("its
        latest timestamp is updated to the value of current decoding step t ... during the
        whole decoding phase, LazyEviction dynamically maintains a timestamp vector TS_t for
        all retained tokens", Sec. 4; Alg. 1 lines 1-6 at each step t), and treats the prompt
        as Sec. 4 treats generated tokens, born at the step that appends them ("For newly
        generated tokens, MRI is initialized to 0"; MRI 0 means "never been activated since
        its generation"), the prefill being the step that appends the prompt.  "position":
        born at its own position, as if each prompt query were a step though none is tracked
        (kvsieve before issue 35): the first activation at step t records t + (prompt length
        - 1 - position), hundreds of steps for an early token of a long prompt, which keeps
        H1 = 2 sigma(-(t - TS)/MRI) near 1 for as long.  Not offered: letting a prompt token's
        first decoding activation set TS without recording a gap; it would time prompt tokens
        from their first activation but generated ones from their birth, and score a prompt
        token activated once like one never activated (MRI 0: H1 = 0 once idle).  With
        ``observe_prompt=True`` both values agree: each prompt token is born at its own step.
    analysis : str, default "kvsieve-mri.json"
        File written by ``kvsieve analyze mri``, read when ``window="auto"``.
    """

    about = About("lagged eviction every W steps: W recent + top B-W by MRI-centric importance",
                  "LazyEviction (ACL submission) Sec. 4 Eqs. 1, 2, 5, Alg. 1: W=25 Tables 3/9; alpha Table 10 / "
                  "App. C (llama 5e-4, qwen 1e-4, by the model's type; SmolLM2, Qwen2.5 and mistral: family value "
                  "extrapolated); H2 falling with MRI as Sec. 4's text and App. D say (h2='printed': the printed, "
                  "rising formula); "
                  "timestamps over decoding steps only, the prompt born at the prefill, step 0 (Sec. 4, Alg. 1); "
                  "interval = W, budget >= 2W")
    # new tokens: born now (TS = own position), MRI 0 (Sec. 4); per-token scores: evicted in place
    # observes_steps: T decode steps' rows in one call are Alg. 1 run T times (observe_timestamps)
    needs = Needs(meta={"ts": TS_UNSET, "mri": 0.0}, observes=True, observes_steps=True, slot_order_free=True,
                  stacks_layers=True)
    # compress_prefill False: Alg. 1 line 8 / App. B, eviction only "at the decoding step t = kW", k in N+,
    # never at the prefill (the prompt is scored like generated tokens, App. H.2); protect_prompt False:
    # App. H.2-H.3 "we treat Prefill and Decode tokens equally": prompt tokens compete.  Interval and recent
    # window: W (``window_interval``, ``window_recent``), set per instance in __post_init__
    defaults = Defaults(interval=DEFAULT_WINDOW, compress_prefill=False, protect_prompt=False,
                        recent_doc="window", interval_doc="window (W); needs budget >= 2W")

    window: int | str = DEFAULT_WINDOW
    alpha: float | None = None
    family: str = MODEL_FAMILY
    head_reduction: str = "mean"
    h2: str = "text"
    observe_prompt: bool = False
    prompt_birth: str = "prefill"
    analysis: str = "kvsieve-mri.json"
    # the alpha of the generate call in progress (``attach``), when alpha follows the model's family
    call_alpha: float | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.window == "auto":
            self.window = read_window(self.analysis)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"lazy window must be a positive integer or 'auto', got {self.window!r}")
        self.alpha = resolve_alpha(self.alpha, self.family, "lazy")
        check_choice(self.head_reduction, HEAD_REDUCTIONS, "lazy head_reduction")
        if self.h2 in _RENAMED_H2:
            raise ValueError(f"lazy h2 must be one of {list(H2_FORMS)}{_renamed_hint(self.h2)}")
        check_choice(self.h2, H2_FORMS, "lazy h2")
        check_choice(self.prompt_birth, PROMPT_BIRTHS, "lazy prompt_birth")
        # lagged eviction every W decode steps, the W newest tokens kept
        self.defaults = replace(self.defaults, interval=self.window_interval, recent=self.window_recent)

    def window_interval(self, budget: int | None) -> int:
        """The interval is W, Alg. 1 line 8: "if t == kW ... Update KV pairs according to Eq. 5"
        (Sec. 4: "KV eviction are triggered at periodic intervals t = kW"); one W is both the
        interval and the recent window of Eq. 5.

        kvsieve caps every default interval at ``budget // 2`` so that a budget stays a bound
        (``Policy``: the cache peaks at B + interval <= 1.5 B).  Below B = 2W that cap would
        part the interval from W, so such a budget is refused, naming the fix, rather than W
        lowered: W is the hyperparameter the paper tunes per model and task (80% MRI threshold,
        App. C; Table 9) and also the recent window, so a quietly smaller W would run another
        method than the settings name, and the paper's regime is B >> W ("When the number of KV
        pairs exceeds the predefined budget B (B >> W)", Sec. 4); B >= 2W is a weak form of it.

        An explicit ``interval`` never reaches this: ``Policy`` keeps it as given, as for every
        method, and records it in the settings; ``window`` sets the interval and the recent
        window together, as Alg. 1 does.
        """
        # deviation: an explicit interval != W is allowed, not refused: it is how a wrapper sets its
        # own schedule (caote:lazy evicts every step) and how a run varies the schedule alone
        if budget is not None and budget < 2 * self.window:
            lower = f" or set window={budget // 2}" if budget >= 2 else ""
            raise SettingError("budget", f"lazy: window W={self.window} needs budget >= 2W={2 * self.window} so the "
                               f"interval stays W (Alg. 1 line 8) and the cache peaks at B + W <= 1.5 B; got budget "
                               f"B={budget}: raise {{name}} to {2 * self.window}{lower}")
        return self.window

    def window_recent(self, budget: int) -> int:
        """The recent window: W.  Policy asks this with the budget when no recent window is set.
        With the default interval, ``window_interval`` has already required B >= 2W; this guards an
        explicit interval."""
        if self.window >= budget:
            raise ValueError(f"lazy window W={self.window} must be smaller than the budget B={budget}: "
                             f"the cache keeps the W newest tokens plus the top B - W (Eq. 5) and peaks at "
                             f"B + W; lower window or raise the budget")
        return self.window

    def attach(self, model, tokenizer):
        """For one generate call: alpha from the model's family when ``family="auto"``."""
        return alpha_for_call(self, model)

    def observe(self, layer, probs, query_pos, steps=False):
        # probs: [B, H_kv, G, T, cap]; T > 1: a prefill chunk, or with ``steps`` T decode steps
        if probs.shape[3] > 1 and not steps and not self.observe_prompt:  # a prefill chunk: only births
            born = prefill_timestamps(layer, query_pos) if self.prompt_birth == "prefill" else born_timestamps(layer)
            layer.meta["ts"].copy_(born)
            return
        observe_timestamps(layer, probs, query_pos, threshold(self), self.head_reduction, track_mri=True)

    def score(self, layer, seen_tokens):
        now = (seen_tokens - 1).to(torch.float32)[:, None, None]  # t: the last query's position
        idle = now - born_timestamps(layer)  # t - TS, [B, H_kv, cap]
        return importance(idle, layer.meta["mri"], self.h2)
