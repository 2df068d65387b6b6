"""JSONL in and out exactly: integers at and past orjson's 64-bit edges are read and written as written."""

import pytest

from kvrescue.jsonl import dumps_line, read_jsonl

# orjson reads -2**63 .. 2**64 - 1 as integers and anything past them as floats; the edges, and one past each
EDGES = [2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -(2 ** 63), -(2 ** 63) - 1, -(10 ** 19), -(2 ** 64)]


@pytest.mark.parametrize("value", EDGES)
def test_an_integer_at_or_past_64_bits_goes_through_a_jsonl_file_exactly(tmp_path, value):
    line = f'{{"gt": {value}, "meta": {{"n": [{value}, 1.5]}}}}\n'
    (tmp_path / "in.jsonl").write_text(line)
    ((number, record),) = read_jsonl(tmp_path / "in.jsonl")
    assert number == 1 and type(record["gt"]) is int and record == {"gt": value, "meta": {"n": [value, 1.5]}}
    assert dumps_line(record).decode() == line.replace(" ", "")
