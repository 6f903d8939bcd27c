"""lmi_handler/batch/shards.py: the fixed line ranges of a batch file and the finished shards' record files."""
from __future__ import annotations

import json

import pytest

from lmi_handler.batch.results import ResultFiles, line_error_record, success_record
from lmi_handler.batch.shards import ShardFiles, cut_shards, merge_records
from lmi_handler.protocol.batch_lines import BatchDefaults, LineError, check_lines
from tests.batch.helpers import COMPLETIONS, batch_line, read_jsonl


def lines_of(custom_ids: list[str]) -> list[str]:
    return [json.dumps(batch_line(cid, {"prompt": "Hi", "max_tokens": 2}, COMPLETIONS)) + "\n" for cid in custom_ids]


def checked(texts: list[str]):
    return check_lines(texts, BatchDefaults())


def record(custom_id: str) -> dict:
    return success_record(custom_id, "req", {"choices": [{"text": custom_id}]})


def test_shards_are_fixed_ranges_of_input_lines_counted_with_blank_lines():
    texts = lines_of([f"r{i}" for i in range(7)])
    texts.insert(3, "\n")                       # line 4 is blank: it still counts in the ranges
    shards = list(cut_shards(checked(texts), 3, set()))
    assert [(s.first_line, s.last_line) for s in shards] == [(1, 3), (4, 6), (7, 9)]
    assert [[item.custom_id for item in s.items] for s in shards] == [["r0", "r1", "r2"], ["r3", "r4"], ["r5", "r6"]]
    assert [item.line for item in shards[1].items] == [5, 6]
    assert shards[0].name == "lines-000000001-000000003"


def test_lines_with_a_result_are_left_out_and_a_finished_shard_is_not_cut_at_all():
    shards = list(cut_shards(checked(lines_of([f"r{i}" for i in range(6)])), 2, {"id:r0", "id:r2", "id:r3"}))
    assert [(s.first_line, [i.custom_id for i in s.items]) for s in shards] == [(1, ["r1"]), (5, ["r4", "r5"])]


def test_a_custom_id_of_an_earlier_shard_is_a_duplicate_in_a_later_one():
    shards = list(cut_shards(checked(lines_of(["a", "b", "c", "a"])), 2, set()))
    duplicate = shards[1].items[1]
    assert isinstance(duplicate, LineError) and duplicate.code == "duplicate_custom_id" and duplicate.line == 4


def test_shard_lines_below_one_are_refused():
    with pytest.raises(ValueError, match="shard_lines must be >= 1, got 0"):
        list(cut_shards(checked(lines_of(["a"])), 0, set()))


def test_a_saved_shard_is_one_whole_file_and_no_temp_file_stays(tmp_path):
    files = ShardFiles(tmp_path / "out.jsonl")
    (shard,) = cut_shards(checked(lines_of(["a", "b"])), 10, set())
    path = files.save(shard, [record("a"), record("b")])
    assert path == tmp_path / "out.jsonl.shards" / "lines-000000001-000000010.jsonl"
    assert [r["custom_id"] for r in read_jsonl(path)] == ["a", "b"]
    assert [p.name for p in files.root.iterdir()] == [path.name]


def test_merging_writes_each_key_once_even_when_merged_twice_or_saved_by_two_runs(tmp_path):
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    files = ShardFiles(out)
    first, second = cut_shards(checked(lines_of(["a", "b", "c", "d"])), 2, set())
    files.save(first, [record("a"), record("b")])
    files.save(second, [record("c"), line_error_record(LineError(4, "d", "invalid_url", "bad url"))])
    with ResultFiles(out, errors) as results:
        assert files.merge_into(results) == 4
        assert files.merge_into(results) == 0
    files.save(first, [record("a"), record("b")])       # the same shard recomputed and saved again
    with ResultFiles(out, errors) as results:
        assert files.merge_into(results) == 0
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a", "b", "c"]
    assert [r["custom_id"] for r in read_jsonl(errors)] == ["d"]
    files.clear()
    assert not files.root.exists() and files.paths() == []


def test_a_shard_with_a_lone_surrogate_custom_id_saves_and_merges_back_as_the_result_files_write_it(tmp_path):
    out = tmp_path / "out.jsonl"
    files = ShardFiles(out)
    (shard,) = cut_shards(checked(lines_of(["a"])), 10, set())
    files.save(shard, [record("a\ud800")])            # a JSON "\ud800" escape in the input gives this custom_id
    with ResultFiles(out) as results:
        assert files.merge_into(results) == 1
        assert merge_records(results, [record("a\ud800"), record("b")]) == 1   # in memory: only the new key
    assert [r["custom_id"] for r in read_jsonl(out)] == ["a\ud800", "b"]
