"""Benchmark loading by name from a data folder, from any JSONL, and its errors."""


import pytest

from kvrescue.data import BENCHES, BUNDLED, load_problems, source_of
from kvrescue.errors import InputError
from tests.helpers import ROOT

SIZES = {"math500": 500, "gsm8k": 1319, "aime24": 30, "amc23": 40, "olympiadbench": 675}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_each_benchmark_loads_bundled_with_its_size_and_answers(name, monkeypatch):
    monkeypatch.delenv("KVRESCUE_DATA_DIR", raising=False)
    loaded = load_problems(name)
    assert loaded.source == str(BUNDLED / f"{name}.jsonl") and source_of(name, None).startswith("bundled: ")
    problems = loaded.problems
    assert len(problems) == SIZES[name] == BENCHES[name].size
    assert [p.idx for p in problems] == list(range(SIZES[name]))
    assert all(p.problem.strip() and p.gt.strip() for p in problems)


def test_raw_answers_follow_each_benchmarks_rule():
    folder = BUNDLED
    assert load_problems("gsm8k", folder=folder).problems[0].gt.strip() == "18"
    assert load_problems("amc23", folder=folder).problems[0].gt == "27.0"
    assert load_problems("math500", folder=folder, limit=3).problems[2].gt  # from the solution's last \boxed{}


def test_the_demos_easy_set_loads_as_a_generic_jsonl():
    """examples/easy.jsonl (scripts/demo.sh): two sums, each answer the sum."""
    problems = load_problems(str(ROOT / "examples" / "easy.jsonl")).problems
    assert [(p.idx, p.gt) for p in problems] == [(0, "5"), (1, "12")]
    assert "3 apples" in problems[0].problem and "2 more" in problems[0].problem and "7 + 5" in problems[1].problem


def test_any_jsonl_with_custom_fields(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"q": "1+1?", "a": 2}\n\n{"q": "2+2?", "a": 4}\n')
    problems = load_problems(str(path), problem_field="q", answer_field="a")
    assert problems.name == "mine" and problems.grading_bench == "generic"
    assert [(p.problem, p.gt) for p in problems.problems] == [("1+1?", "2"), ("2+2?", "4")]


def test_missing_problem_field_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok", "answer": "1"}\n{"prompt": "no", "answer": "2"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: missing field 'question'"):
        load_problems(str(path))


def test_unknown_benchmark_is_refused():
    with pytest.raises(InputError, match="unknown benchmark 'math5000'"):
        load_problems("math5000")


def test_missing_file_in_data_folder(tmp_path):
    with pytest.raises(InputError, match="gsm8k.jsonl: benchmark 'gsm8k' not found"):
        load_problems("gsm8k", folder=tmp_path)
