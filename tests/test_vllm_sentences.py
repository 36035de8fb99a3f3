"""SkipKV's sentences inside vLLM (``kvsieve.vllm.sentences``) against plain Python: requests fed
as vLLM's worker feeds them (each forward's tokens flattened, cut by ``query_start_loc``, prefill
chunks beside decode steps, a request that finishes and one that takes its row, a request resumed
after a preemption that recomputes from position 0) hold, once a batch's rows are selected, each
its own sentences: their first positions, their mean hidden states, the sentence of every
position, and Eq. 3's penalty.  And what stays refused: other per-token hooks, SkipKV's steering,
prefix caching.  Plain torch, no vLLM: runs in the main environment."""

import random

import pytest
import torch

from kvsieve.cache import DEAD_POS
from kvsieve.methods import make_policy
from kvsieve.methods.skipkv import SentenceTable
from kvsieve.vllm.sentences import RequestSentences, sentence_reader

DELIMS, VOCAB, D = (3, 7), 10, 16


class Reference:
    """Each request's tokens and hidden states as plain lists, sentences cut by hand."""

    def __init__(self):
        self.seen: dict[str, list[tuple[int, list[float]]]] = {}

    def sentences(self, req_id: str) -> list[tuple[int, list[float], int]]:
        """(first position, mean hidden state, tokens) of each sentence, the open one last if begun."""
        out, current = [], []
        for pos, (tok, hidden) in enumerate(self.seen[req_id]):
            current.append((pos, hidden))
            if tok in DELIMS:  # a sentence includes its delimiter (App. A.1)
                out.append(current)
                current = []
        if current:
            out.append(current)
        return [(s[0][0], [sum(h[k] for _, h in s) / len(s) for k in range(D)], len(s)) for s in out]

    def closed(self, req_id: str) -> int:
        return sum(tok in DELIMS for tok, _ in self.seen[req_id])

    def sentence_at(self, req_id: str, pos: int) -> int:
        return sum(tok in DELIMS for tok, _ in self.seen[req_id][:pos])

    def penalty(self, req_id: str, tau: float, min_tokens: int) -> list[float]:
        """Eq. 3: lambda_i, the largest cosine of closed sentence i to a later closed one, if above tau."""
        sents = self.sentences(req_id)[:self.closed(req_id)]
        lam = []
        for i, (_, a, n) in enumerate(sents):
            best = max((cosine(a, b) for _, b, m in sents[i + 1:] if m >= min_tokens), default=-2.0)
            lam.append(best if n >= min_tokens and best > tau else 0.0)
        return lam


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def forward(feeder: RequestSentences, ref: Reference, rng: random.Random, step: dict[str, int],
            tokens: dict[str, list[int]] | None = None) -> None:
    """One vLLM forward of ``step`` (request -> tokens this step, in the batch's order), flattened:
    new random tokens (or the request's ``tokens`` to recompute) at each request's next positions."""
    ids, pos, starts = [], [], [0]
    for req_id, n in step.items():
        have = len(ref.seen.setdefault(req_id, []))
        new = tokens[req_id][have:have + n] if tokens and req_id in tokens else [rng.randrange(VOCAB) for _ in range(n)]
        ids += new
        pos += range(have, have + n)
        starts.append(starts[-1] + n)
    hidden = torch.randn(len(ids), D)
    for i, req_id in enumerate(step):
        for j in range(starts[i], starts[i + 1]):
            ref.seen[req_id].append((ids[j], hidden[j].tolist()))
    feeder.feed(list(step), starts, torch.tensor(ids, dtype=torch.int32), torch.tensor(pos), hidden)


def check(feeder: RequestSentences, ref: Reference, batch: list[str], tau: float = 0.0, min_tokens: int = 2):
    feeder.select(batch)
    table = feeder.table
    rows = table.rows
    lam = table.penalty(tau, min_tokens)
    for b, req_id in enumerate(batch):
        sents = ref.sentences(req_id)
        row = int(rows[b])
        assert int(table.open[row]) == ref.closed(req_id)
        assert table.start[row, :len(sents)].tolist() == [first for first, _, _ in sents]
        assert bool((table.start[row, len(sents):] == DEAD_POS).all())
        assert table.count[row, :len(sents)].tolist() == [n for _, _, n in sents]
        means = table.total[row, :len(sents)] / table.count[row, :len(sents), None]
        assert torch.allclose(means, torch.tensor([m for _, m, _ in sents]), atol=1e-5)
        n = len(ref.seen[req_id])
        got = table.sentence_of(torch.arange(n).repeat(len(batch), 1, 1))[b, 0]
        assert got.tolist() == [ref.sentence_at(req_id, p) for p in range(n)]
        want = ref.penalty(req_id, tau, min_tokens)
        assert torch.allclose(lam[b, :len(want)], torch.tensor(want), atol=1e-5)
        assert bool((lam[b, len(want):] == 0).all())


def test_each_request_holds_its_own_sentences_as_vllms_worker_feeds_them():
    rng = random.Random(0)
    torch.manual_seed(0)
    feeder, ref = RequestSentences(SentenceTable(torch.tensor(DELIMS))), Reference()
    forward(feeder, ref, rng, {"a": 23, "b": 9})  # two prompts in one forward
    forward(feeder, ref, rng, {"a": 1, "b": 17, "c": 30})  # a decode beside a prefill chunk and a new prompt
    for _ in range(12):
        forward(feeder, ref, rng, {"c": 1, "a": 1, "b": 1})  # the batch reordered by vLLM
    check(feeder, ref, ["b", "c", "a"])  # a compacted batch's rows, in its order
    check(feeder, ref, ["b", "c", "a"] * 3)  # the rows of a stack of three layers, layer-major
    check(feeder, ref, ["c"])
    # a finishes; d takes its row and must see none of a's sentences
    feeder.forget("a")
    del ref.seen["a"]
    forward(feeder, ref, rng, {"d": 14, "b": 1, "c": 1})
    for _ in range(5):
        forward(feeder, ref, rng, {"b": 1, "c": 1, "d": 1})
    check(feeder, ref, ["d", "b"])
    # b is resumed after a preemption: its prompt and outputs recomputed from position 0, in two chunks
    tokens = {"b": [tok for tok, _ in ref.seen.pop("b")]}
    feeder.forget("b")
    forward(feeder, ref, rng, {"c": 1, "b": 20, "d": 1}, tokens)
    forward(feeder, ref, rng, {"b": len(tokens["b"]) - 20, "c": 1}, tokens)
    assert [tok for tok, _ in ref.seen["b"]] == tokens["b"]
    check(feeder, ref, ["b", "c", "d"])
    assert feeder.table.num_rows >= 3 and len(feeder.row_of) == 3


def test_rows_grow_for_more_live_requests_than_the_first_forward_had():
    rng = random.Random(1)
    torch.manual_seed(1)
    feeder, ref = RequestSentences(SentenceTable(torch.tensor(DELIMS), capacity=4)), Reference()
    forward(feeder, ref, rng, {"r0": 12})
    for i in range(1, 6):  # more requests, and more sentences than the table's first capacity
        forward(feeder, ref, rng, {f"r{j}": 1 for j in range(i)} | {f"r{i}": 10 + i})
    check(feeder, ref, [f"r{i}" for i in (5, 0, 3)], tau=0.2)
    assert 6 <= feeder.table.num_rows < 12  # doubled as needed, not per request


def test_a_batch_with_a_request_never_fed_is_refused_in_one_line():
    feeder = RequestSentences(SentenceTable(torch.tensor(DELIMS)))
    with pytest.raises(RuntimeError, match=r"request\(s\) \['x'\] are compacted before any of their tokens"):
        feeder.select(["x"])


def test_the_sentence_reader_is_found_inside_a_wrapper():
    policy = make_policy("ams:skipkv", budget=64)
    assert sentence_reader(policy.scorer).name == "skipkv"
    assert policy.scorer.needs.sentences == make_policy("skipkv", budget=64).scorer.needs.sentences != ()


# ---------------------------------------------------------------- what is served, what stays refused
def test_skipkv_is_served_and_other_per_token_hooks_are_not():
    from types import SimpleNamespace

    from kvsieve.policy import Needs
    from kvsieve.vllm.plan import SieveSettings, unserved

    assert SieveSettings.from_config({"method": "skipkv", "budget": 64}).policy.scorer.name == "skipkv"
    hook = SimpleNamespace(scorer=SimpleNamespace(needs=Needs(per_token_hook=True)))
    assert "per-token host hook" in unserved(hook)


def test_skipkvs_steering_is_refused_in_one_line():
    from kvsieve.vllm.plan import SieveSettings
    from kvsieve.vllm.serve import check_passthrough

    for refuse in (lambda: SieveSettings.from_config({"method": "skipkv", "budget": 64,
                                                      "options": {"steering": "steer.pt"}}),
                   lambda: check_passthrough(["--steering", "steer.pt"])):
        with pytest.raises(ValueError, match=r"SkipKV's adaptive steering \(Sec. 4.2\) is not served inside vLLM") \
                as err:
            refuse()
        assert "\n" not in str(err.value)


def test_prefix_caching_is_refused_for_skipkv_even_with_the_prompt_kept():
    from kvsieve.vllm.prefix import uncacheable

    why = uncacheable(make_policy("skipkv", budget=64, protect_prompt=True), "skipkv")
    assert "last hidden state" in why and "--no-enable-prefix-caching" in why
