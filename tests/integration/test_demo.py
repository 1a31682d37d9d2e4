"""The README's quick-start command: trains to a good accuracy and leaves no process behind."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def wait_gone(text: str, deadline: float) -> list[int]:
    while processes_mentioning(text) and time.monotonic() < deadline:
        time.sleep(0.1)  # processes exit asynchronously; bounded by the deadline
    return processes_mentioning(text)


def demo(tmp_path, *args):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the launcher's run directory goes here
    # A child inherits an ignored SIGINT (a shell's background job ignores it, and Python then
    # installs no KeyboardInterrupt) but not a handler: with one here, the demo starts with
    # SIGINT's default, so the Ctrl-C test means the same wherever the tests run.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # -X faulthandler: a demo that hangs dumps every thread's stack on SIGABRT (see below).
        return subprocess.Popen(
            [
                sys.executable,
                "-X",
                "faulthandler",
                "-m",
                "paramserve.coordinator.commands.cli",
                "demo",
                "--quiet",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def test_demo_trains_reports_json_and_stops_every_process(tmp_path):
    process = demo(tmp_path, "--steps", "600", "--json", "--checkpoint-dir", str(tmp_path / "ckpt"))
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["test_accuracy"] >= 0.9
    assert (summary["steps"], summary["workers"], summary["parameter_servers"]) == (600, 2, 2)
    assert (pathlib.Path(summary["checkpoint_dir"]) / "LATEST").exists()
    # It printed its status page's address as it started (with the key of its cluster's token).
    assert re.search(r"status page: http://127\.0\.0\.1:\d+/\?key=[0-9a-f]{64}", err)
    assert summary["status_url"] in err
    assert wait_gone(str(tmp_path), time.monotonic() + 30) == []

    # The sidecar evaluator reads the parameter servers' checkpoints from the files alone.
    evaluator = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserve.coordinator.commands.cli",
            "evaluator",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--max-evaluations",
            "1",
            "--every",
            "0.1",
            "--json",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluator.returncode == 0, evaluator.stderr
    evaluation = json.loads(evaluator.stdout.strip().splitlines()[-1])
    assert evaluation["accuracy"] == pytest.approx(summary["test_accuracy"])
    assert list((tmp_path / "logs" / "validation").glob("events.out.tfevents.*"))


@pytest.mark.timeout(300)  # the start-up (120 s) and the stop (120 s) deadlines below, on a loaded machine
def test_ctrl_c_stops_every_process_the_demo_started(tmp_path):
    process = demo(tmp_path, "--steps", "100000")
    deadline = time.monotonic() + 120
    while len(processes_mentioning(str(tmp_path))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting for the cluster's four servers to exist
    assert len(processes_mentioning(str(tmp_path))) >= 4, "the demo never started its cluster"
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # faulthandler writes where every thread is
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        pytest.fail(f"the demo did not stop within 120 s of Ctrl-C; its stderr:\n{err[-6000:]}")
    assert process.returncode != 0, err
    assert wait_gone(str(tmp_path), time.monotonic() + 30) == []
