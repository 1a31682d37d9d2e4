"""LocalCluster against a fake server: real processes, real sockets, 127.0.0.1 only.

The fake stands in for ``paramserve.psserver`` / ``paramserve.worker``: it binds
127.0.0.1 (port 0 or the --port it is given), writes the --port-file contract
atomically, accepts connections until SIGTERM, and misbehaves on request.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from paramserve.coordinator.cluster import ClusterSpec, parse_address
from paramserve.coordinator.local_cluster import (
    ClusterState,
    LaunchError,
    LocalCluster,
    PortReport,
    parse_port_report,
)

FAKE_MODULE = "paramserve_fake_server"
FAKE_SERVER = textwrap.dedent(
    """
    import argparse, json, os, signal, socket, stat, sys, threading

    def exit_when_stdin_closes():
        while os.read(0, 4096):
            pass
        os._exit(0)

    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--host", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--port-file", required=True)
        p.add_argument("--token-file")
        p.add_argument("--fail-at-start", action="store_true")
        p.add_argument("--never-ready", action="store_true")
        p.add_argument("--ignore-sigterm", action="store_true")
        p.add_argument("--stop-when-stdin-closes", action="store_true")
        args = p.parse_args()
        if args.stop_when_stdin_closes:
            threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
        if args.host != "127.0.0.1":
            sys.exit("fake server: refusing to bind anything but 127.0.0.1")
        print("fake server: starting", flush=True)
        marks = {name: os.environ.get(name) for name in ("PYTHONUNBUFFERED", "PARAMSERVE_TEST_MARK")}
        print("fake server: env", json.dumps(marks), flush=True)
        if args.fail_at_start:
            print("fake server: configuration broken on purpose", file=sys.stderr, flush=True)
            sys.exit(3)
        expected = os.environ.get("FAKE_EXPECT_TOKEN")
        if expected is not None:
            mode = stat.S_IMODE(os.stat(args.token_file).st_mode)
            with open(args.token_file) as f:
                token = f.read()
            if mode != 0o600 or token != expected:
                sys.exit(f"fake server: token file mode {oct(mode)} or content wrong")
        signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else lambda *_: sys.exit(0))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen()
        if args.never_ready:
            while True:
                signal.pause()
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": sock.getsockname()[1], "metrics_port": None, "pid": os.getpid()}, f)
        os.replace(tmp, args.port_file)
        print("fake server: serving on", sock.getsockname()[1], flush=True)
        while True:
            conn, _ = sock.accept()
            conn.close()

    main()
    """
)


# ------------------------------------------------------------------ helpers


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def connect(address: str) -> None:
    host, port = parse_address(address)
    assert host == "127.0.0.1"  # never anything else
    with socket.create_connection((host, port), timeout=5):
        pass


def refuses(address: str) -> bool:
    try:
        connect(address)
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture(scope="module")
def fake_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("fake_server")
    (directory / f"{FAKE_MODULE}.py").write_text(FAKE_SERVER)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.fixture
def make_cluster(fake_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    made: list[LocalCluster] = []

    def make(num_ps: int = 2, num_workers: int = 2, **kwargs: object) -> LocalCluster:
        kwargs.setdefault("run_dir", tmp_path / f"run{len(made)}")
        kwargs.setdefault("startup_timeout", 30.0)
        env = {**fake_env, **kwargs.pop("env", {})}  # type: ignore[dict-item]
        cluster = LocalCluster(
            num_ps,
            num_workers,
            env=env,
            ps_module=FAKE_MODULE,
            worker_module=FAKE_MODULE,
            **kwargs,  # type: ignore[arg-type]
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:  # a safety net: every test stops its cluster itself
        cluster.stop()


# ------------------------------------------------------------------ start / stop


def test_start_serves_every_port_and_stop_leaves_no_process(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_ps=2, num_workers=3)
    spec = cluster.start()
    assert isinstance(spec, ClusterSpec) and spec == cluster.spec
    assert (spec.num_ps(), spec.num_workers()) == (2, 3)
    for address in spec.parameter_servers + spec.workers:
        connect(address)

    infos = cluster.processes
    assert [(p.role, p.index) for p in infos] == [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert [p.address for p in infos] == list(spec.parameter_servers + spec.workers)
    for info in infos:
        assert info.running and is_alive(info.pid)
        assert os.getpgid(info.pid) == info.pid != os.getpgid(0)  # own group: Ctrl-C does not reach it
        assert "fake server: serving on" in info.log_path.read_text()

    cluster.stop()
    assert cluster.state is ClusterState.STOPPED
    for info in infos:
        assert not is_alive(info.pid)
        assert refuses(info.address)  # type: ignore[arg-type]
    assert not any(p.running for p in cluster.processes)
    cluster.stop()  # idempotent


def test_context_manager_starts_and_stops(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=1, num_workers=1) as cluster:
        pids = [p.pid for p in cluster.processes]
        connect(cluster.spec.workers[0])
    assert pids and not any(is_alive(pid) for pid in pids)


def test_exception_in_with_block_stops_every_process(make_cluster: Callable[..., LocalCluster]) -> None:
    pids: list[int] = []
    with pytest.raises(ZeroDivisionError):
        with make_cluster() as cluster:
            pids = [p.pid for p in cluster.processes]
            raise ZeroDivisionError("the program fails")
    assert len(pids) == 4 and not any(is_alive(pid) for pid in pids)


def test_stop_sigkills_a_server_that_ignores_sigterm(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_ps=1, num_workers=1, extra_ps_args=("--ignore-sigterm",))
    cluster.start()
    pids = [p.pid for p in cluster.processes]
    began = time.monotonic()
    cluster.stop(timeout=0.5)
    assert time.monotonic() - began < 10
    assert not any(is_alive(pid) for pid in pids)


def test_owned_run_dir_is_removed_and_token_file_is_private(make_cluster: Callable[..., LocalCluster]) -> None:
    token = "s3cret-token-value"
    cluster = make_cluster(num_ps=1, num_workers=1, run_dir=None, token=token, env={"FAKE_EXPECT_TOKEN": token})
    cluster.start()  # the fake exits unless its token file is 0600 and holds the token
    run_dir = cluster.run_dir
    assert run_dir is not None
    assert stat.S_IMODE(os.stat(run_dir / "token").st_mode) == 0o600
    for info in cluster.processes:
        command_line = Path(f"/proc/{info.pid}/cmdline").read_bytes()  # what ps shows
        assert b"--token-file" in command_line
        assert token.encode() not in command_line
    cluster.stop()
    assert not run_dir.exists()


def test_children_run_unbuffered_with_the_given_env(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=1, num_workers=1, env={"PARAMSERVE_TEST_MARK": "42"}) as cluster:
        log = cluster.processes[0].log_path.read_text()
    assert 'fake server: env {"PYTHONUNBUFFERED": "1", "PARAMSERVE_TEST_MARK": "42"}' in log, log


def test_a_cluster_starts_once(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=1, num_workers=1) as cluster:
        with pytest.raises(RuntimeError, match="create a new one"):
            cluster.start()
    with pytest.raises(RuntimeError, match="create a new one"):
        cluster.start()


# ------------------------------------------------------------------ kill / restart


def test_kill_and_restart_worker_on_the_same_port(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=1, num_workers=2) as cluster:
        spec = cluster.spec
        old = cluster.processes[1]
        assert (old.role, old.index) == ("worker", 0)

        cluster.kill_worker(0)
        assert not is_alive(old.pid)  # kill_worker returns once the process is gone
        assert refuses(spec.workers[0])
        assert not cluster.processes[1].running
        connect(spec.workers[1])  # the others are untouched

        cluster.restart_worker(0)
        new = cluster.processes[1]
        assert new.pid != old.pid and new.running
        assert new.address == old.address == spec.workers[0]
        assert cluster.spec == spec
        connect(spec.workers[0])
        log = new.log_path.read_text()
        assert log.count("--- paramserve launcher:") == 2  # one log across restarts, a marker per launch
    assert not is_alive(new.pid)


def test_kill_and_restart_ps_on_the_same_port(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=2, num_workers=1) as cluster:
        address = cluster.spec.parameter_servers[1]
        old_pid = cluster.processes[1].pid
        cluster.kill_ps(1)
        assert not is_alive(old_pid) and refuses(address)
        cluster.restart_ps(1)
        assert cluster.processes[1].pid != old_pid
        connect(address)


def test_a_supervised_cluster_restarts_a_killed_server_on_its_port(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=2, num_workers=1, supervise=True) as cluster:
        address = cluster.spec.parameter_servers[1]
        old_pid = cluster.processes[1].pid
        os.kill(old_pid, signal.SIGKILL)  # from outside, as a crash would
        deadline = time.monotonic() + 30
        while cluster.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling: the supervisor's restart has no event to wait on
        assert cluster.restarts == 1 and cluster.processes[1].pid != old_pid
        connect(address)


def test_restart_of_a_live_worker_replaces_it(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=1, num_workers=1) as cluster:
        old_pid = cluster.processes[1].pid
        cluster.restart_worker(0)
        assert not is_alive(old_pid)
        connect(cluster.spec.workers[0])


def test_bad_index_and_not_running(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_ps=1, num_workers=2)
    with pytest.raises(RuntimeError, match="call start"):
        cluster.kill_worker(0)
    with cluster:
        with pytest.raises(IndexError, match=r"worker index 2 is out of range: the cluster has 2 \(0..1\)"):
            cluster.kill_worker(2)
        with pytest.raises(IndexError, match="ps index -1"):
            cluster.restart_ps(-1)


# ------------------------------------------------------------------ failures at start-up


def test_server_exiting_at_startup_raises_launch_error_with_its_stderr(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    cluster = make_cluster(num_ps=2, num_workers=2, extra_worker_args=("--fail-at-start",))
    with pytest.raises(LaunchError) as info:
        cluster.start()
    message = str(info.value)
    assert "exited with code 3 before it was ready" in message
    assert "fake server: configuration broken on purpose" in message
    assert "worker-0.log" in message
    assert cluster.state is ClusterState.STOPPED
    pids = [p.pid for p in cluster.processes]
    assert len(pids) == 4 and not any(is_alive(pid) for pid in pids)  # the healthy ones were stopped too


def test_silent_server_times_out(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_ps=1, num_workers=1, extra_ps_args=("--never-ready",), startup_timeout=1.0)
    with pytest.raises(LaunchError, match=r"not ready within 1s \(no port file .* yet\).*raise startup_timeout"):
        cluster.start()
    assert not any(is_alive(p.pid) for p in cluster.processes)


def test_missing_module_is_reported(fake_env: dict[str, str], tmp_path: Path) -> None:
    cluster = LocalCluster(
        1, 1, run_dir=tmp_path, env=fake_env, ps_module="paramserve_no_such_module", worker_module=FAKE_MODULE
    )
    try:
        with pytest.raises(LaunchError, match="No module named paramserve_no_such_module"):
            cluster.start()
    finally:
        cluster.stop()


def test_restart_fails_when_the_port_is_taken(make_cluster: Callable[..., LocalCluster]) -> None:
    with make_cluster(num_ps=1, num_workers=1) as cluster:
        address = cluster.spec.workers[0]
        cluster.kill_worker(0)
        squatter = socket.socket()
        try:
            squatter.bind(parse_address(address))
            squatter.listen()
            with pytest.raises(LaunchError, match="Address already in use"):
                cluster.restart_worker(0)
        finally:
            squatter.close()
        cluster.restart_worker(0)  # the port is free again
        connect(address)


def test_constructor_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="at least one parameter server"):
        LocalCluster(num_ps=0)
    with pytest.raises(ValueError, match="integer >= 0"):
        LocalCluster(num_workers=-1)
    with pytest.raises(ValueError, match="non-empty string"):
        LocalCluster(token="")
    with pytest.raises(ValueError, match="positive number"):
        LocalCluster(startup_timeout=0)


# ------------------------------------------------------------------ the parent goes away

PARENT = textwrap.dedent(
    """
    import json, signal, sys, threading
    from pathlib import Path
    from paramserve.coordinator.local_cluster import LocalCluster

    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode, module, run_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    cluster = LocalCluster(1, 2, run_dir=run_dir, ps_module=module, worker_module=module)
    cluster.start()
    print(json.dumps([p.pid for p in cluster.processes]), flush=True)
    if mode == "interrupt":
        threading.Event().wait()  # until Ctrl-C
    sys.stdin.readline()  # the test saw the processes alive: end now
    if mode == "error":
        raise RuntimeError("the user's program failed")
    # mode "exit": end without stop(); the atexit hook must stop the cluster
    """
)


@pytest.mark.parametrize("mode", ["interrupt", "error", "exit"])
def test_parent_ending_without_stop_stops_the_cluster(mode: str, fake_env: dict[str, str], tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode, FAKE_MODULE, str(tmp_path / "run")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **fake_env},
        text=True,
    )
    pids: list[int] = []
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line, f"parent died early: {parent.communicate(timeout=30)[1]}"
        pids = json.loads(line)
        assert len(pids) == 3 and all(is_alive(pid) for pid in pids)
        if mode == "interrupt":
            parent.send_signal(signal.SIGINT)
        else:  # the parent waits for this line: it ends only after the check above
            parent.stdin.write("end\n")  # type: ignore[union-attr]
            parent.stdin.flush()  # type: ignore[union-attr]
        _, stderr = parent.communicate(timeout=60)
        assert parent.returncode != 0 if mode != "exit" else parent.returncode == 0, stderr
        if mode == "interrupt":
            assert "KeyboardInterrupt" in stderr
        assert "stopping the local cluster at interpreter exit" in stderr
        assert not any(is_alive(pid) for pid in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        for pid in pids:  # never leak a server, whatever failed above
            if is_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


KILLED_PARENT = textwrap.dedent(
    """
    import json, sys, threading
    from pathlib import Path
    from paramserve.coordinator.local_cluster import LocalCluster

    cluster = LocalCluster(1, 1, run_dir=Path(sys.argv[1]))
    cluster.start()
    print(json.dumps([p.pid for p in cluster.processes]), flush=True)
    threading.Event().wait()  # until SIGKILLed: no atexit hook, no signal handler runs
    """
)


def test_real_servers_stop_when_the_program_that_launched_them_is_sigkilled(tmp_path: Path) -> None:
    """An OOM kill or a `kill -9` of the user's program runs none of its cleanup: its servers
    notice the end of the pipe it held as their stdin (--stop-when-stdin-closes) and stop."""
    parent = subprocess.Popen(
        [sys.executable, "-c", KILLED_PARENT, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line, f"parent died early: {parent.communicate(timeout=30)[1]}"
        pids = json.loads(line)
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        parent.kill()
        parent.communicate(timeout=30)
        deadline = time.monotonic() + 60
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in pids), "a server outlived the program that launched it"
        logs = "".join(path.read_text() for path in (tmp_path / "run").glob("*.log"))
        assert logs.count("the launcher is gone (standard input closed): stopping") == 2, logs
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        for pid in pids:  # never leak a server, whatever failed above
            if not gone(pid):
                os.killpg(pid, signal.SIGKILL)


# ------------------------------------------------------------------ the port-file contract


def test_parse_port_report() -> None:
    assert parse_port_report('{"port": 5, "metrics_port": null, "pid": 9}') == PortReport(5, None, 9)
    assert parse_port_report('{"port": 5, "metrics_port": 6, "pid": 9}') == PortReport(5, 6, 9)
    for bad in (
        '{"port": 5',
        "[5]",
        '{"port": 0, "pid": 9}',
        '{"port": "5", "pid": 9}',
        '{"port": 5, "metrics_port": 70000, "pid": 9}',
        '{"port": 5, "pid": true}',
    ):
        with pytest.raises(ValueError, match="contract"):
            parse_port_report(bad)


def test_failed_start_keeps_the_logs_of_an_owned_run_dir(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(num_ps=1, num_workers=1, run_dir=None, extra_ps_args=("--fail-at-start",))
    with pytest.raises(LaunchError):
        cluster.start()
    run_dir = cluster.run_dir
    assert run_dir is not None
    try:
        assert "configuration broken on purpose" in (run_dir / "ps-0.log").read_text()
    finally:
        shutil.rmtree(run_dir)


def test_real_servers_size_their_torch_threads_to_their_share(start_cluster: Callable[..., LocalCluster]) -> None:
    from paramserve.psserver.runtime import cpus

    cluster = start_cluster(num_ps=1, num_workers=2, run_dir=None)
    sharing = {cpus.PROCESSES_ENV: "4"}  # 1 ps + 2 workers + the program driving them
    expected = cpus.torch_threads(None, sharing)
    for process in cluster.processes:
        assert f"{expected} torch threads" in process.log_path.read_text(), process.log_path.read_text()[-2000:]
