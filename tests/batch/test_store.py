"""batch/store.py: ids nobody can guess, ids of any other shape never reaching SQLite, and the quota over
everything under batch_dir (fast: a real store in a temporary directory)."""
from __future__ import annotations

import errno
import io
import uuid

import pytest

from lmi_handler.batch.store import BatchStore, QuotaExceeded


def test_file_and_batch_ids_are_random_uuid4s_so_one_id_tells_nothing_of_another(tmp_path):
    store = BatchStore(tmp_path)
    files = [store.add_file("in.jsonl", "batch", io.BytesIO(b"{}\n"))["id"] for _ in range(64)]
    batches = [store.add_batch("/v1/chat/completions", files[0], "24h", None, {})["id"] for _ in range(64)]
    for prefix, ids in (("file-", files), ("batch_", batches)):
        assert len(set(ids)) == len(ids)
        parsed = [uuid.UUID(hex=i.removeprefix(prefix)) for i in ids]
        assert {u.version for u in parsed} == {4}                # 122 random bits each
        assert len({i[len(prefix):len(prefix) + 8] for i in ids}) == len(ids)     # no shared, counting prefix
    neighbour = files[0][:-1] + ("0" if files[0][-1] != "0" else "1")
    assert store.get_file(neighbour) is None


@pytest.mark.parametrize("bad", ["file-\ud800", "../state.sqlite3", "file-" + "A" * 32, "", "file-x", "\udcff" * 40])
def test_ids_of_any_other_shape_are_unknown_without_touching_sqlite(tmp_path, bad):
    store = BatchStore(tmp_path)
    assert store.get_file(bad) is None and store.get_batch(bad.replace("file-", "batch_")) is None
    assert store.delete_file(bad) is False
    assert store.list_batches(after=bad, limit=5) == ([], False)


def test_the_quota_counts_every_file_under_batch_dir_and_refuses_what_would_pass_it(tmp_path):
    store = BatchStore(tmp_path, max_total_bytes=64 << 10)
    used = store.used_bytes()
    assert used == (tmp_path / "state.sqlite3").stat().st_size > 0         # the SQLite state counts too
    store.add_file("a.jsonl", "batch", io.BytesIO(b"x" * 10_000))
    assert store.used_bytes() >= used + 10_000
    (store.work_dir("batch_" + "0" * 32) / "output.jsonl").write_bytes(b"y" * 5_000)   # a job's results count
    assert store.used_bytes() >= used + 15_000
    store.check_room((64 << 10) - store.used_bytes())                        # exactly full is allowed
    with pytest.raises(QuotaExceeded, match="batch_max_total_bytes = 65536") as over:
        store.check_room((64 << 10) - store.used_bytes() + 1)
    assert over.value.errno == errno.EDQUOT and over.value.limit == 64 << 10
    BatchStore(tmp_path / "open").check_room(1 << 50)                        # no quota set: anything goes
