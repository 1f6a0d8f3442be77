"""tvm_tpp.bench.workers: JSON-line worker processes (echo, environment, time-out, death)."""

import os
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import tvm_tpp
from tvm_tpp.bench.workers import Worker, WorkerError, last_line

_CHILD = textwrap.dedent("""
    import json, os, sys, time
    print("started", file=sys.stderr, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        if "env" in request:
            print(json.dumps({"value": os.environ.get(request["env"])}), flush=True)
        elif "sleep" in request:
            time.sleep(request["sleep"])
        elif "die" in request:
            print("last words", file=sys.stderr, flush=True)
            os._exit(request["die"])
        elif "garble" in request:
            print("not json", flush=True)
        else:
            print(json.dumps(request), flush=True)
""")


def _worker(tmp_path, env=None):
    return Worker([sys.executable, "-c", _CHILD], tmp_path / "logs" / "child.log", env)


def test_echo_environment_and_quit(tmp_path):
    worker = _worker(tmp_path, {"TVM_NUM_THREADS": "3"})
    try:
        assert worker.request({"a": [1, 2]}, timeout=60) == {"a": [1, 2]}
        assert worker.request({"env": "TVM_NUM_THREADS"}, timeout=60) == {"value": "3"}
        path = worker.request({"env": "PYTHONPATH"}, timeout=60)["value"]
        assert path.split(os.pathsep)[0] == str(Path(tvm_tpp.__file__).resolve().parents[1])
    finally:
        worker.close()
    assert worker.proc.returncode == 0  # quit on request, not killed
    assert last_line(worker.log_path) == "started"


def test_time_out_kills_the_worker(tmp_path):
    worker = _worker(tmp_path)
    with pytest.raises(WorkerError, match="timed out after 1 s"):
        worker.request({"sleep": 60}, timeout=1)
    assert worker.proc.returncode is not None and worker.proc.returncode < 0
    worker.close()
    assert not psutil.Process().children(recursive=True)


def test_death_reports_status_and_the_log_s_last_line(tmp_path):
    worker = _worker(tmp_path)
    with pytest.raises(WorkerError, match="worker exited with status 7: last words"):
        worker.request({"die": 7}, timeout=60)
    with pytest.raises(WorkerError, match="status 7"):  # later requests fail alike
        worker.request({"a": 1}, timeout=60)
    worker.close()


def test_garbled_reply_kills_the_worker(tmp_path):
    worker = _worker(tmp_path)
    with pytest.raises(WorkerError, match="garbled reply 'not json"):
        worker.request({"garble": True}, timeout=60)
    assert worker.proc.poll() is not None
    worker.close()


def test_last_line(tmp_path):
    path = tmp_path / "log"
    path.write_text("first\n  second  \n\n")
    assert last_line(path) == "second"
    assert last_line(path, limit=3) == "sec"
    assert last_line(tmp_path / "missing") == ""
