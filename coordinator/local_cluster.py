"""LocalCluster: parameter servers and workers as local processes on 127.0.0.1.

Used by ``paramserve demo``, by the integration tests (as a fixture) and by users
who want a cluster on one machine::

    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = ParameterServerStrategy(cluster.spec)
        ...

Each server runs ``python -m <module>`` in its own session. By default it is forked from a
zygote (psserver/runtime/zygote.py) that has imported torch but never gRPC (gRPC and fork do not mix), so
a start or restart costs a fraction of a second instead of torch's import (BENCHMARKS.md,
``startup.py``); ``preload=False``, or a zygote
that cannot start, gives a fresh interpreter each. A Ctrl-C in the terminal reaches only this process,
which then stops the servers itself: from ``__exit__``, from ``start()`` when it
fails, or from an ``atexit`` hook when the program ends without stopping them. A program
killed outright (SIGKILL, the OOM killer) runs none of these; each server's stdin is a pipe
this process holds, and a server started with ``--stop-when-stdin-closes`` stops once it
closes, so no server outlives its program.
A server asked for ``--port 0`` picks a free port and reports it through the
``--port-file`` contract: once serving it atomically writes
``{"port": int, "metrics_port": int | null, "pid": int}`` to that path.
"""

from __future__ import annotations

import atexit
import enum
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.psserver.protocol.errors import ConfigurationError
from paramserve.psserver.runtime.cpus import PROCESSES_ENV, torch_threads, usable_cpus
from paramserve.psserver.runtime.zygote import ZygoteError, shared_zygote

__all__ = ["ClusterState", "LaunchError", "LocalCluster", "PortReport", "ProcessInfo", "parse_port_report"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
PS = "ps"
WORKER = "worker"
_TAIL_LINES = 40
_TAIL_BYTES = 64 * 1024
_POLL_SECONDS = 0.02
_KILL_WAIT_SECONDS = 10.0
_SUPERVISE_SECONDS = 0.25
_PORT_FILE_CONTRACT = '{"port": int, "metrics_port": int | null, "pid": int}'


class LaunchError(RuntimeError):
    """A process of the local cluster did not come up; the message carries the tail of its log."""


class ClusterState(enum.Enum):
    """The lifecycle of a LocalCluster; a cluster starts at most once."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"


_TRANSITIONS: Mapping[ClusterState, frozenset[ClusterState]] = {
    ClusterState.NEW: frozenset({ClusterState.STARTING, ClusterState.STOPPED}),
    ClusterState.STARTING: frozenset({ClusterState.RUNNING, ClusterState.STOPPED}),
    ClusterState.RUNNING: frozenset({ClusterState.STOPPED}),
    ClusterState.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class ProcessInfo:
    """A snapshot of one server process: ``address`` is None until it reported its port."""

    role: str
    index: int
    pid: int
    address: str | None
    metrics_port: int | None
    log_path: Path
    running: bool


@dataclass(frozen=True)
class PortReport:
    """What a server wrote to its --port-file."""

    port: int
    metrics_port: int | None
    pid: int


class ChildProcess(Protocol):
    """What the cluster needs of a started process: ``subprocess.Popen``, or a
    ``PreloadedProcess`` forked by a zygote."""

    pid: int
    stdin: IO[bytes] | None
    returncode: Any

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class _Child:
    """One launched process. ``port`` is the port asked for (0: any) until the server reports one."""

    role: str
    index: int
    proc: ChildProcess
    port_file: Path
    log_path: Path
    log_offset: int
    port: int
    metrics_port: int | None = None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index} (pid {self.proc.pid})"


class LocalCluster:
    """Parameter servers and workers on 127.0.0.1, started by ``start()`` and stopped by ``stop()``.

    ``token`` reaches the children through a 0600 file (``--token-file``), never
    argv. ``run_dir`` (one per cluster) holds one log per process (stdout and
    stderr together, appended across restarts), the port files and the token
    file; when None a temporary directory is made and removed by ``stop()``
    unless ``start()`` failed (pass ``run_dir`` to keep the logs). Children
    inherit ``os.environ`` updated with ``env`` and ``PYTHONUNBUFFERED=1``.
    ``ps_module`` / ``worker_module`` name what ``python -m`` runs; ``extra_*_args``
    follow the launcher's own flags. With ``supervise``, a thread restarts any child
    that exits while the cluster runs, on its port (as Compose's or Kubernetes' restart
    policy would; ``paramserve launch`` supervises). Raises ``ValueError`` on a bad
    configuration.
    """

    def __init__(
        self,
        num_ps: int = 2,
        num_workers: int = 2,
        *,
        token: str | None = None,
        run_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        extra_ps_args: Sequence[str] = (),
        extra_worker_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        ps_module: str = "paramserve.psserver",
        worker_module: str = "paramserve.worker",
        supervise: bool = False,
        preload: bool = True,
    ) -> None:
        _check_config(num_ps, num_workers, token, startup_timeout)
        self._num = {PS: num_ps, WORKER: num_workers}
        self._token = token
        self._requested_run_dir = Path(run_dir) if run_dir is not None else None
        self._env = dict(env or {})
        self._extra_args = {PS: tuple(extra_ps_args), WORKER: tuple(extra_worker_args)}
        self._modules = {PS: ps_module, WORKER: worker_module}
        self._startup_timeout = startup_timeout
        self._lock = threading.RLock()
        self._state = ClusterState.NEW
        self._children: dict[str, list[_Child]] = {PS: [], WORKER: []}
        self._run_dir: Path | None = None
        self._owns_run_dir = False
        self._keep_run_dir = False
        self._token_file: Path | None = None
        self._child_env: dict[str, str] = {}
        self._spec: ClusterSpec | None = None
        self._supervise = supervise
        self._preload = preload
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._threads: _SharedThreads | None = None
        self.restarts = 0
        """Children the supervisor restarted."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ClusterSpec | None:
        """Launch every server, wait until each reported its port, and return the cluster.

        A cluster of parameter servers only (num_workers=0) has no ClusterSpec:
        start() returns None and ``parameter_servers`` lists the addresses.
        Raises ``LaunchError`` (after stopping everything it started) when a server
        exits or stays silent past ``startup_timeout``; ``RuntimeError`` if called twice.
        """
        with self._lock:
            self._transition(ClusterState.STARTING)
            atexit.register(self._stop_at_exit)
            try:
                self._prepare_run_dir()
                for role in (PS, WORKER):
                    for index in range(self._num[role]):
                        self._children[role].append(self._launch(role, index, port=0))
                deadline = time.monotonic() + self._startup_timeout
                for child in self._all_children():
                    self._await_ready(child, deadline)
                self._spec = self._current_spec() if self._num[WORKER] else None
            except BaseException:
                self._keep_run_dir = True  # its logs explain the failure
                self.stop()
                raise
            self._transition(ClusterState.RUNNING)
            self._threads = _SharedThreads.take(self._num[PS] + self._num[WORKER] + 1)
            logger.info("local cluster running: %s", self._spec)
            if self._supervise:
                self._supervisor = threading.Thread(
                    target=self._supervise_children, name="paramserve-supervisor", daemon=True
                )
                self._supervisor.start()
            return self._spec

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every server, wait up to ``timeout`` seconds, SIGKILL what remains.

        Safe to call any number of times, from any state; the token file is
        deleted, and the run directory too when the cluster made it.
        """
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout)
        with self._lock:
            if self._state is ClusterState.STOPPED:
                return
            children = self._all_children()
            for child in children:
                _signal_group(child.proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for child in children:
                _wait_until(child.proc, deadline)
            for child in children:
                if child.proc.poll() is None:
                    logger.warning("%s ignored SIGTERM for %.1fs: sending SIGKILL", child.name, timeout)
                    _kill_and_reap(child.proc)
            self._clean_run_dir()
            if self._threads is not None:
                self._threads.give_back()
                self._threads = None
            # Last, so that an interrupted stop() is finished by the atexit hook.
            self._state = ClusterState.STOPPED
            atexit.unregister(self._stop_at_exit)
            logger.info("local cluster stopped")

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def state(self) -> ClusterState:
        return self._state

    @property
    def spec(self) -> ClusterSpec:
        """The cluster's addresses (ports never change: restarts reuse them). Raises if never started."""
        if self._spec is None:
            raise RuntimeError("the local cluster has no spec yet: call start() or use it in a with-block")
        return self._spec

    @property
    def parameter_servers(self) -> tuple[str, ...]:
        """Addresses of the parameter servers (also for a cluster without workers)."""
        with self._lock:
            return tuple(f"{HOST}:{c.port}" for c in self._children[PS])

    @property
    def processes(self) -> tuple[ProcessInfo, ...]:
        """A snapshot of every process launched and not replaced since: parameter servers, then workers."""
        with self._lock:
            return tuple(_info(child) for child in self._all_children())

    @property
    def run_dir(self) -> Path | None:
        return self._run_dir

    # ------------------------------------------------------------------ membership

    def add_worker(self) -> str:
        """Starts one more worker and returns its address once it serves (``spec`` lists it from
        then on). A running coordinator takes it with ``ClusterCoordinator.add_worker(address)``.
        Raises LaunchError when it exits or stays silent past ``startup_timeout``."""
        with self._lock:
            if self._state is not ClusterState.RUNNING:
                raise RuntimeError(f"the local cluster is {self._state.value}, not running: call start() first")
            child = self._launch(WORKER, len(self._children[WORKER]), port=0)
            try:
                self._await_ready(child, time.monotonic() + self._startup_timeout)
            except BaseException:
                _kill_and_reap(child.proc)
                raise
            self._children[WORKER].append(child)
            self._spec = self._current_spec()
            return f"{HOST}:{child.port}"

    # ------------------------------------------------------------------ fault injection

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index``; returns once the process is gone."""
        self._kill(WORKER, index)

    def restart_worker(self, index: int) -> None:
        """Start a new worker ``index`` on the same port (stopping the old one if alive); returns when ready."""
        self._restart(WORKER, index)

    def kill_ps(self, index: int) -> None:
        """SIGKILL parameter server ``index``; returns once the process is gone."""
        self._kill(PS, index)

    def restart_ps(self, index: int) -> None:
        """Start a new parameter server ``index`` on the same port; returns when ready."""
        self._restart(PS, index)

    def terminate_ps(self, index: int, timeout: float = _KILL_WAIT_SECONDS) -> int:
        """SIGTERM parameter server ``index`` (a graceful stop: it drains, as an orchestrator's
        stop or rolling update asks) and wait for it to exit; returns its exit code. Raises
        TimeoutError when it still runs after ``timeout`` seconds."""
        with self._lock:
            child = self._running_child(PS, index)
            _signal_group(child.proc, signal.SIGTERM)
            if not _wait_until(child.proc, time.monotonic() + timeout):
                raise TimeoutError(f"{child.name} still runs {timeout:g}s after SIGTERM")
            logger.info("stopped %s gracefully (exit code %s)", child.name, child.proc.returncode)
            return int(child.proc.returncode)

    def _kill(self, role: str, index: int) -> None:
        with self._lock:
            child = self._running_child(role, index)
            _kill_and_reap(child.proc)
            logger.info("killed %s", child.name)

    def _restart(self, role: str, index: int) -> None:
        with self._lock:
            old = self._running_child(role, index)
            if old.proc.poll() is None:
                _signal_group(old.proc, signal.SIGTERM)
                if not _wait_until(old.proc, time.monotonic() + _KILL_WAIT_SECONDS):
                    _kill_and_reap(old.proc)
            _let_go(old.proc)
            new = self._launch(role, index, port=old.port)
            self._children[role][index] = new  # recorded first: stop() must reach it whatever happens
            try:
                self._await_ready(new, time.monotonic() + self._startup_timeout)
            except BaseException:
                _kill_and_reap(new.proc)
                raise
            logger.info("restarted %s on port %d", new.name, new.port)

    # ------------------------------------------------------------------ supervision

    def _supervise_children(self) -> None:
        """Restarts children that exited (polling: a child's exit has no event to wait on)."""
        while not self._stopping.wait(_SUPERVISE_SECONDS):
            with self._lock:
                if self._stopping.is_set() or self._state is not ClusterState.RUNNING:
                    return
                exited = [c for c in self._all_children() if c.proc.poll() is not None]
                for child in exited:
                    logger.warning(
                        "%s exited with %s: restarting it on port %d", child.name, child.proc.returncode, child.port
                    )
                    try:
                        self._restart(child.role, child.index)
                        self.restarts += 1
                    except Exception:
                        logger.exception("could not restart %s", child.name)

    # ------------------------------------------------------------------ internals

    def _transition(self, to: ClusterState) -> None:
        if to not in _TRANSITIONS[self._state]:
            raise RuntimeError(
                f"local cluster cannot go from {self._state.value} to {to.value}: a LocalCluster "
                "starts once; create a new one"
            )
        self._state = to

    def _stop_at_exit(self) -> None:
        logger.warning("stopping the local cluster at interpreter exit (stop() was not called)")
        self.stop()

    def _all_children(self) -> list[_Child]:
        return self._children[PS] + self._children[WORKER]

    def _running_child(self, role: str, index: int) -> _Child:
        if self._state is not ClusterState.RUNNING:
            raise RuntimeError(f"the local cluster is {self._state.value}, not running: call start() first")
        count = len(self._children[role])
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise IndexError(f"{role} index {index!r} is out of range: the cluster has {count} (0..{count - 1})")
        return self._children[role][index]

    def _prepare_run_dir(self) -> None:
        if self._requested_run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="paramserve-cluster-"))
            self._owns_run_dir = True
        else:
            self._run_dir = self._requested_run_dir
            self._run_dir.mkdir(parents=True, exist_ok=True)
        if self._token is not None:
            self._token_file = _write_secret(self._run_dir / "token", self._token)
        # Every child sizes its torch threads to its share of the machine (psserver/runtime/cpus.py):
        # the servers, the workers and the program that drives them share these cores.
        sharing = {PROCESSES_ENV: str(self._num[PS] + self._num[WORKER] + 1)}
        self._child_env = {**os.environ, **sharing, **self._env, "PYTHONUNBUFFERED": "1"}

    def _clean_run_dir(self) -> None:
        if self._token_file is not None:
            self._token_file.unlink(missing_ok=True)
        if self._owns_run_dir and self._run_dir is not None:
            if self._keep_run_dir:
                logger.warning("start-up failed: keeping the logs in %s", self._run_dir)
            else:
                shutil.rmtree(self._run_dir, ignore_errors=True)

    def _argv(self, role: str, port: int, port_file: Path) -> list[str]:
        argv = [sys.executable, "-m", self._modules[role], "--host", HOST, "--port", str(port)]
        argv += ["--port-file", str(port_file), "--stop-when-stdin-closes"]
        if self._token_file is not None:
            argv += ["--token-file", str(self._token_file)]
        return argv + list(self._extra_args[role])

    def _launch(self, role: str, index: int, port: int) -> _Child:
        assert self._run_dir is not None
        port_file = self._run_dir / f"{role}-{index}.port.json"
        port_file.unlink(missing_ok=True)  # a stale file would read as ready at once
        log_path = self._run_dir / f"{role}-{index}.log"
        argv = self._argv(role, port, port_file)
        with open(log_path, "ab") as log:
            log.write(f"--- paramserve launcher: {' '.join(argv)}\n".encode())
            log.flush()
            offset = log.tell()
            proc = self._start_process(argv, log)
        logger.info("launched %s %d (pid %d), port %s, log %s", role, index, proc.pid, port or "any", log_path)
        return _Child(role, index, proc, port_file, log_path, offset, port)

    def _start_process(self, argv: list[str], log: IO[bytes]) -> ChildProcess:
        """``argv`` (``python -m module ...``) forked from the shared zygote, or as a fresh
        interpreter when ``preload`` is off, the module is not paramserve's (the zygote's
        preloads may mean nothing to it, and a module of one's own may be tiny), or the zygote
        cannot start (then for good: a zygote that failed once would cost every later start its
        wait)."""
        if self._preload and argv[2].startswith("paramserve."):
            try:
                return shared_zygote(self._child_env).spawn(argv[2], argv[3:], self._child_env, log)
            except ZygoteError as err:
                logger.warning("starting processes as fresh interpreters: %s", err)
                self._preload = False
        return subprocess.Popen(
            argv,
            # A pipe only this process holds (not inherited: Python's pipes are close-on-exec):
            # it closes when this process ends however it ends, and the server then stops
            # (--stop-when-stdin-closes), so no server outlives a killed program.
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._child_env,
            start_new_session=True,
            close_fds=True,
        )

    def _await_ready(self, child: _Child, deadline: float) -> None:
        """Wait for the port file while the process lives. paramserve's servers write it
        only after their gRPC health service reports SERVING, so the file means ready."""
        while True:
            report, problem = _read_port_file(child.port_file, child.proc.pid)
            code = child.proc.poll()
            if code is not None:
                raise LaunchError(f"{child.name} {_describe_exit(code)} before it was ready; {_tail_message(child)}")
            if report is not None:
                self._accept_report(child, report)
                return
            if time.monotonic() >= deadline:
                _kill_and_reap(child.proc)
                raise LaunchError(
                    f"{child.name} was not ready within {self._startup_timeout:g}s ({problem}): "
                    f"raise startup_timeout if it is only slow, else see why; {_tail_message(child)}"
                )
            time.sleep(_POLL_SECONDS)

    def _accept_report(self, child: _Child, report: PortReport) -> None:
        if child.port not in (0, report.port):
            _kill_and_reap(child.proc)
            raise LaunchError(
                f"{child.name} was asked for port {child.port} but reported {report.port}: "
                "the server must honour --port"
            )
        child.port, child.metrics_port = report.port, report.metrics_port
        logger.info("%s ready on %s:%d", child.name, HOST, report.port)

    def _current_spec(self) -> ClusterSpec:
        return ClusterSpec(
            parameter_servers=tuple(f"{HOST}:{c.port}" for c in self._children[PS]),
            workers=tuple(f"{HOST}:{c.port}" for c in self._children[WORKER]),
        )


# ---------------------------------------------------------------------- helpers


def _read_port_file(path: Path, expected_pid: int | None = None) -> tuple[PortReport | None, str]:
    """Read a --port-file: ``(report, "")`` when valid, else ``(None, why not)``."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, f"no port file {path} yet"
    try:
        report = parse_port_report(text)
    except ValueError as e:
        return None, f"port file {path}: {e}"
    if expected_pid is not None and report.pid != expected_pid:
        return (
            None,
            f"port file {path} was written by pid {report.pid}, not by the process launched (pid {expected_pid})",
        )
    return report, ""


def parse_port_report(text: str) -> PortReport:
    """Parse the --port-file JSON; raises ValueError naming what breaks the contract."""
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"not JSON ({text[:200]!r}); the contract is {_PORT_FILE_CONTRACT}") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object ({text[:200]!r}); the contract is {_PORT_FILE_CONTRACT}")
    port, metrics_port, pid = data.get("port"), data.get("metrics_port"), data.get("pid")
    if not _is_port(port) or not (metrics_port is None or _is_port(metrics_port)) or not _is_int(pid):
        raise ValueError(f"{data!r} breaks the contract {_PORT_FILE_CONTRACT} (ports in 1..65535)")
    return PortReport(port=int(port), metrics_port=None if metrics_port is None else int(metrics_port), pid=int(pid))  # type: ignore[arg-type]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_port(value: object) -> bool:
    return _is_int(value) and 0 < value <= 65535  # type: ignore[operator]


def _check_config(num_ps: int, num_workers: int, token: str | None, startup_timeout: float) -> None:
    if not _is_int(num_ps) or num_ps < 1:
        raise ConfigurationError(
            f"num_ps={num_ps!r}: a cluster needs at least one parameter server; pass an integer >= 1"
        )
    if not _is_int(num_workers) or num_workers < 0:
        # 0 workers is a parameter-server-only cluster (benchmarks, tools); training needs >= 1.
        raise ConfigurationError(f"num_workers={num_workers!r}: pass an integer >= 0")
    if token is not None and (not isinstance(token, str) or not token):
        raise ConfigurationError("token must be a non-empty string, or None to run without authentication")
    if not startup_timeout > 0:
        raise ConfigurationError(f"startup_timeout={startup_timeout!r}: pass a positive number of seconds")


@dataclass
class _SharedThreads:
    """This process's torch threads while it drives a local cluster: its share of the machine,
    as every child's (psserver/runtime/cpus.py). Each process's intra-op pool spins between parallel
    regions, so a program keeping torch's default (one thread per core) beside servers and
    workers stalls them all: measured on 16 cores, a row pull and push ran 11.6x slower than
    with one thread per process. Only taken when the program has not chosen
    (``OMP_NUM_THREADS`` unset and torch at its default); given back at stop() unless the
    program changed it meanwhile."""

    before: int
    share: int

    @staticmethod
    def take(processes: int) -> _SharedThreads | None:
        import torch

        if os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads() != usable_cpus():
            return None
        share = torch_threads(None, {PROCESSES_ENV: str(processes)})
        if share == torch.get_num_threads():
            return None
        before = torch.get_num_threads()
        torch.set_num_threads(share)
        logger.info(
            "this program shares the machine with the cluster's %d processes: torch threads %d -> %d "
            "until the cluster stops (set OMP_NUM_THREADS to choose)",
            processes - 1,
            before,
            share,
        )
        return _SharedThreads(before, share)

    def give_back(self) -> None:
        import torch

        if torch.get_num_threads() == self.share:
            torch.set_num_threads(self.before)


def _write_secret(path: Path, secret: str) -> Path:
    path.unlink(missing_ok=True)
    # Created 0600 from the start (no window in which another user could read it).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return path


def _signal_group(proc: ChildProcess, sig: int) -> None:
    """Signal the process's group (its own session: any grandchildren go too) if not yet reaped."""
    # While unreaped, the pid (and so the group id) cannot be reused by another process.
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _wait_until(proc: ChildProcess, deadline: float) -> bool:
    """Wait for the process until ``deadline`` (monotonic); True if it has exited."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    _let_go(proc)
    return True


def _let_go(proc: ChildProcess) -> None:
    """Closes this end of an exited child's stdin pipe (its --stop-when-stdin-closes)."""
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:  # the child is gone: nothing left to tell it
            pass


def _kill_and_reap(proc: ChildProcess) -> None:
    _signal_group(proc, signal.SIGKILL)
    if not _wait_until(proc, time.monotonic() + _KILL_WAIT_SECONDS):
        raise LaunchError(
            f"pid {proc.pid} survived SIGKILL for {_KILL_WAIT_SECONDS:g}s (stuck in the kernel?): "
            "check it with ps and stop it by hand"
        )


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _tail_message(child: _Child) -> str:
    tail = _log_tail(child.log_path, child.log_offset)
    if not tail:
        return f"its log {child.log_path} is empty"
    return f"last lines of its log {child.log_path}:\n{tail}"


def _log_tail(path: Path, offset: int, lines: int = _TAIL_LINES) -> str:
    """The last ``lines`` lines written to ``path`` after ``offset`` (this launch only)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - _TAIL_BYTES))
            data = f.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _info(child: _Child) -> ProcessInfo:
    return ProcessInfo(
        role=child.role,
        index=child.index,
        pid=child.proc.pid,
        address=f"{HOST}:{child.port}" if child.port else None,
        metrics_port=child.metrics_port,
        log_path=child.log_path,
        running=child.proc.poll() is None,
    )
