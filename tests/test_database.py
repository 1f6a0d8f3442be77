"""The tuning database: SQLite records shared by threads and processes, each checked when read,
bad files set aside with one warning line, the JSON database of earlier versions migrated."""

import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from schedules.database import FILE_NAME, LEGACY_NAME, Database, TuningKey, check_config
from schedules.gemm import GemmConfig, GemmProblem
from schedules.ops import OPS

PROBLEM = GemmProblem(48, 64, 96)
CONFIG = GemmConfig.of("BCa", 48, 64, 96)
MACHINE = "avx2/haswell/1t"


def _key(m: int = 48) -> TuningKey:
    return TuningKey("dense", (m, 64, 96), "", "float32", "", MACHINE)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "schedules.database"]


def test_put_get_record_and_keys(tmp_path):
    db = Database(tmp_path / FILE_NAME)
    assert len(db) == 0 and db.get(_key()) is None and db.record(_key()) is None
    assert not (tmp_path / FILE_NAME).exists()  # created by the first put
    db.put(_key(), CONFIG, gflops=12.5, measured=[])
    again = Database(tmp_path / FILE_NAME)
    assert again.get(_key()) == CONFIG and again.get(_key(), PROBLEM, "avx2") == CONFIG
    assert again.record(_key()) == {"config": OPS["dense"].to_json(CONFIG), "gflops": 12.5,
                                    "measured": []}
    assert again.keys() == [_key().text()] and len(again) == 1
    db.put(_key(), GemmConfig.of("CBa", 48, 64, 96))  # the last writer's result is kept
    assert again.get(_key()).spec == "CBa"


def test_threads_lose_nothing(tmp_path):
    db = Database(tmp_path / FILE_NAME)
    errors = []

    def writer(first: int) -> None:
        try:
            for m in range(first, first + 25):
                db.put(_key(m), CONFIG, gflops=float(m))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(1 + 100 * t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(Database(tmp_path / FILE_NAME)) == 200


_WRITER = """
import sys
from schedules.database import Database, TuningKey
from schedules.gemm import GemmConfig
db = Database(sys.argv[1])
first = int(sys.argv[2])
kept = []  # the CLI opens one Database per model: several stay open in one process
for m in range(first, first + 200):
    if m % 50 == 0:
        kept.append(db)
        db = Database(sys.argv[1])
    key = TuningKey("dense", (m, 64, 96), "", "float32", "", "avx2/haswell/1t")
    db.put(key, GemmConfig.of("BCa", 8, 64, 96), gflops=float(m))
print("done")
"""


def test_processes_lose_nothing(tmp_path):
    """Four processes writing 200 records each at once (the JSON file lost entries and failed
    on its shared temporary file): every record is there, every process succeeded.  Each
    process opens the database again while its first connections are open (reading the file
    outside SQLite then would drop their locks, and records were lost)."""
    path = tmp_path / "work" / FILE_NAME
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(1 + 1000 * i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outputs]
    db = Database(path)
    assert len(db) == 800
    assert db.record(_key(1 + 3000 + 199))["gflops"] == 3200.0


@pytest.mark.parametrize("content", [b"\xa1\x00\xff random bytes" * 50, b"{not json", b"[]",
                                     b"42", b"SQLite format 3\x00" + b"\x07" * 3000])
def test_a_file_that_is_no_database_is_set_aside(tmp_path, caplog, content):
    path = tmp_path / FILE_NAME
    path.write_bytes(content)
    db = Database(path)
    assert len(db) == 0
    assert (tmp_path / f"{FILE_NAME}.corrupt").read_bytes() == content
    (line,) = _warnings(caplog)
    assert line.startswith(f"tuning database {path} ") and "moved it to tuning.db.corrupt" in line
    db.put(_key(), CONFIG)
    assert Database(path).get(_key()) == CONFIG and _warnings(caplog) == [line]  # told once


def test_a_foreign_sqlite_file_is_set_aside(tmp_path, caplog):
    path = tmp_path / FILE_NAME
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    assert len(Database(path)) == 0 and (tmp_path / f"{FILE_NAME}.corrupt").is_file()
    assert "is another SQLite database" in _warnings(caplog)[0]


def test_a_damaged_database_is_set_aside(tmp_path, caplog):
    path = tmp_path / FILE_NAME
    db = Database(path)
    for m in range(1, 300):
        db.put(_key(m), CONFIG, measured=["x" * 200])
    db.close()
    data = bytearray(path.read_bytes())
    data[4096:len(data) // 2] = os.urandom(len(data) // 2 - 4096)  # past the header
    path.write_bytes(bytes(data))
    Database(path)
    assert "is damaged" in _warnings(caplog)[0]
    assert (tmp_path / f"{FILE_NAME}.corrupt").is_file() and len(Database(path)) == 0


@pytest.mark.parametrize("record, why", [
    ({"config": {"spec": "BCa"}}, "bad config: missing field 'block_steps'"),
    ({"conf": 1}, "holds no config object"),
    ([1, 2], "holds no config object"),
    ({"config": {**OPS["dense"].to_json(CONFIG), "bm": -4}}, "must be a positive int"),
])
def test_a_bad_record_is_dropped_and_retuned(tmp_path, caplog, record, why):
    path = tmp_path / FILE_NAME
    Database(path).put(_key(), CONFIG)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE records SET record = ?", (json.dumps(record),))
    conn.close()
    db = Database(path)
    assert db.get(_key()) is None and len(db) == 0  # deleted: the next tune measures it
    (line,) = _warnings(caplog)
    assert f"tuning database {path}: dropped the invalid record of {_key().text()}" in line
    assert why in line


def test_a_record_that_does_not_fit_its_problem_is_dropped(tmp_path, caplog):
    db = Database(tmp_path / FILE_NAME)
    for spec, why in (("zzz", "letter 'z' names loop 26"), ("BCa", "bm=40 does not divide 48")):
        db.put(_key(), GemmConfig.of(spec, 40 if spec == "BCa" else 48, 64, 96))
        assert db.get(_key()) is not None  # well-formed, so kept for lookups without a problem
        assert db.get(_key(), PROBLEM, "avx2") is None and len(db) == 0
        assert why in _warnings(caplog)[-1]


def test_check_config():
    check_config(PROBLEM, CONFIG, "avx2")
    with pytest.raises(ValueError, match="holds a ConvConfig"):
        from schedules.conv import ConvConfig

        check_config(PROBLEM, ConvConfig(bq=1, bc=1, bk=1))


def _legacy(tmp_path: Path, records) -> Path:
    path = tmp_path / LEGACY_NAME
    path.write_text(json.dumps(records))
    return path


def test_the_json_database_is_migrated_once(tmp_path, caplog):
    good = {"config": OPS["dense"].to_json(CONFIG), "gflops": 3.0}
    _legacy(tmp_path, {_key().text(): good,
                       _key(8).text(): {"config": {"spec": "zzz"}},  # missing fields
                       "nonsense": good, "conv2d|1|f||x": {"config": []}})
    db = Database(tmp_path / FILE_NAME)
    assert db.keys() == [_key().text()] and db.record(_key()) == good
    assert not (tmp_path / LEGACY_NAME).exists()
    assert (tmp_path / f"{LEGACY_NAME}.migrated").is_file()
    (line,) = _warnings(caplog)
    assert line == (f"migrated 1 tuning records from {tmp_path / LEGACY_NAME} into "
                    f"{tmp_path / FILE_NAME}, dropped 3 invalid (to be tuned again); "
                    "the old file is now tuning.json.migrated")
    Database(tmp_path / FILE_NAME)
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("content", ["[]", "42", "{not json", "\xa1"])
def test_a_json_database_of_the_wrong_type_is_set_aside(tmp_path, caplog, content):
    (tmp_path / LEGACY_NAME).write_text(content)
    assert len(Database(tmp_path / FILE_NAME)) == 0
    assert (tmp_path / f"{LEGACY_NAME}.corrupt").read_text() == content
    assert "is not a JSON object of records" in _warnings(caplog)[0]


def test_a_json_database_at_the_path_itself_is_migrated(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({_key().text(): {"config": OPS["dense"].to_json(CONFIG)}}))
    assert Database(path).get(_key()) == CONFIG
    assert (tmp_path / "t.json.migrated").is_file()


def test_a_file_as_work_directory(tmp_path):
    (tmp_path / "work").write_text("")
    with pytest.raises(ValueError, match="is a file, not a work directory"):
        Database(tmp_path / "work" / FILE_NAME)


def test_a_record_tuned_against_another_default_is_stale(tmp_path, caplog):
    """A record whose first measurement (the tuner's default then) is not today's default is
    not used — its winner beat only that old default — and stays in the database."""
    old_default, new_default = GemmConfig.of("CBa", 48, 64, 96), GemmConfig.of("aBC", 48, 64, 96)
    db = Database(tmp_path / FILE_NAME)
    db.put(_key(), CONFIG, measured=[{"config": OPS["dense"].to_json(old_default)}])
    assert db.get(_key()) == CONFIG and db.get(_key(), default=old_default) == CONFIG
    assert not _warnings(caplog)
    assert db.get(_key(), PROBLEM, "avx2", default=new_default) is None
    assert db.get(_key(), default=new_default) is None and len(db) == 1
    (line,) = _warnings(caplog)  # once per key
    assert f"{_key().text()} was tuned against an older default configuration" in line
    db.put(_key(), CONFIG, measured=[])  # nothing measured (a record put by hand): kept
    assert db.get(_key(), default=new_default) == CONFIG
