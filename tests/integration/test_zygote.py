"""Processes forked from a zygote (psserver/runtime/zygote.py) behave as `python -m` ones would, and a
LocalCluster started from one trains and recovers as before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from paramserve.coordinator import LocalCluster
from paramserve.psserver.runtime.zygote import Zygote, ZygoteError, shared_zygote

PROBE = """
import json, os, sys
watched = ("grpc", "numpy", "torch", "torch._dynamo", "paramserve.coordinator")
preloaded = sorted(name for name in watched if name in sys.modules)
import numpy
report = {
    "argv": sys.argv[1:],
    "main": __name__,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "flag": os.environ.get("PARAMSERVE_PROBE_FLAG"),
    "sid_is_pid": os.getsid(0) == os.getpid(),
    "preloaded": preloaded,
    "random": numpy.random.randint(1 << 30),
}
print(json.dumps(report), flush=True)
import atexit, threading, time
atexit.register(lambda: print("atexit ran"))
sys.stdin.read()  # until the caller closes our stdin
late = threading.Thread(target=lambda: (time.sleep(0.2), print("late thread done")))
late.start()  # not a daemon: the exit waits for it, then runs the atexit functions
sys.exit(int(sys.argv[1]))
"""


def _start_zygote(directory):
    (directory / "zygote_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = Zygote(env, cwd=str(directory))
    started.start()
    return started, env


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    started, env = _start_zygote(tmp_path_factory.mktemp("zygote"))
    yield started, env
    started.close()


@pytest.fixture
def own_zygote(tmp_path):
    started, env = _start_zygote(tmp_path)
    yield started, env
    started.close()


def _report(path, process, deadline=30.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        text = path.read_text() if path.exists() else ""
        if text.endswith("\n"):
            return json.loads(text.splitlines()[0])
        assert process.poll() is None, f"the child exited with {process.returncode}: {text}"
        time.sleep(0.02)  # polling a file the child writes; bounded by the deadline
    raise AssertionError(f"no report in {path}")


def test_a_forked_child_runs_its_module_as_python_m_would(zygote, tmp_path):
    started, env = zygote
    out = tmp_path / "out.log"
    with open(out, "wb") as log:
        child = started.spawn("zygote_probe", ["3", "x"], {**env, "PARAMSERVE_PROBE_FLAG": "on"}, log)
    report = _report(out, child)
    assert report["argv"] == ["3", "x"]
    assert report["main"] == "__main__"
    assert report["path0"] == report["cwd"]
    assert os.path.exists(os.path.join(report["cwd"], "zygote_probe.py"))
    assert report["flag"] == "on", "a PARAMSERVE_* variable may differ from the zygote's"
    assert report["sid_is_pid"], "each child leads a session of its own (signals to its group reach only it)"
    # torch, numpy and what torch imports at a process's first optimizer step; never grpc
    assert report["preloaded"] == ["numpy", "torch", "torch._dynamo"]
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.stdin.close()  # the child reads stdin to its end, then exits with argv[1]
    assert child.wait(timeout=30) == 3
    assert child.returncode == 3
    tail = out.read_text().splitlines()[1:]
    assert tail == ["late thread done", "atexit ran"], "exits as an interpreter does, in that order"
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)  # reaped once its exit was seen, as Popen's child is


def test_a_killed_child_reports_its_signal_and_children_have_their_own_random_streams(zygote, tmp_path):
    started, env = zygote
    children, reports = [], []
    for index in range(2):
        out = tmp_path / f"out{index}.log"
        with open(out, "wb") as log:
            children.append(started.spawn("zygote_probe", ["0"], env, log))
        reports.append(_report(out, children[-1]))
    assert reports[0]["random"] != reports[1]["random"], "numpy's global generator is reseeded in each child"
    os.killpg(children[0].pid, signal.SIGKILL)
    assert children[0].wait(timeout=30) == -signal.SIGKILL
    assert children[1].poll() is None
    children[1].stdin.close()
    assert children[1].wait(timeout=30) == 0


def test_an_environment_beyond_paramserve_variables_needs_another_zygote(zygote, tmp_path):
    started, env = zygote
    with open(tmp_path / "out.log", "wb") as log, pytest.raises(ZygoteError, match="PARAMSERVE_"):
        started.spawn("zygote_probe", ["0"], {**env, "OMP_NUM_THREADS": "7"}, log)
    first = shared_zygote({**env, "PARAMSERVE_PROBE_FLAG": "1"})
    assert shared_zygote({**env, "PARAMSERVE_PROBE_FLAG": "2"}) is first
    assert shared_zygote({**env, "PARAMSERVE_PROBE_FLAG": "1", "OMP_NUM_THREADS": "1"}) is not first


def test_children_of_a_lost_zygote_are_stopped_and_count_as_killed(own_zygote, tmp_path):
    started, env = own_zygote
    out = tmp_path / "out.log"
    with open(out, "wb") as log:
        child = started.spawn("zygote_probe", ["0"], env, log)
    _report(out, child)
    started._process.kill()  # the zygote dies: nothing could report the child's exit any more
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert not started.alive
    with open(out, "ab") as log, pytest.raises(ZygoteError, match="gone"):
        started.spawn("zygote_probe", ["0"], env, log)


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def test_a_cluster_forks_its_processes_from_the_zygote_and_restarts_them(start_cluster):
    cluster = start_cluster(num_ps=1, num_workers=1)
    server, worker = cluster.processes
    parent = int(open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()[1])
    assert parent != os.getpid()
    assert any(b"paramserve.psserver.runtime.zygote" in part for part in _cmdline(parent)), "forked by the zygote"
    shown = b" ".join(_cmdline(server.pid))
    assert b" -m paramserve.psserver --host 127.0.0.1 --port 0 " in shown, "ps shows the python -m command line"
    cluster.kill_worker(0)
    cluster.restart_worker(0)
    restarted = cluster.processes[1]
    assert restarted.pid != worker.pid
    assert restarted.running
    assert restarted.address == worker.address
    assert cluster.terminate_ps(0) == 0, "a forked server stops cleanly on SIGTERM, as a fresh one does"


def test_without_preload_the_cluster_starts_fresh_interpreters(tmp_path):
    with LocalCluster(num_ps=1, num_workers=0, preload=False, run_dir=tmp_path) as cluster:
        cmdline = _cmdline(cluster.processes[0].pid)
        assert cmdline[1:3] == [b"-m", b"paramserve.psserver"], cmdline
    assert sys.executable.encode() == cmdline[0]
