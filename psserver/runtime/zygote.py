"""Starting servers and workers from a process that has imported torch already (a *zygote*).

A server or worker spends most of its start importing torch: about 2 s of CPU on a small
machine, more than everything else it does before it serves. A launcher starts several, and
starts them again after every failure. A zygote imports torch once and forks each of them from
there, so a start costs only what is particular to it (its own modules, its server). Android
starts its apps this way, and torch's DataLoader forks its workers from the same state.

Forking is safe here because the zygote holds nothing a fork breaks: it never imports grpc
(gRPC's state does not survive a fork) nor initialises CUDA, and it runs a single thread of its
own (the BLAS pool that numpy starts handles fork itself). The child runs its module as
``python -m`` would, with the environment, working directory, stdin, output and session the
caller asked for, ``random`` and numpy's global generator seeded afresh, and its command line
as ``ps`` shows it set to the ``python -m`` one (setproctitle; /proc/<pid>/environ then no
longer lists its environment).

What the zygote imported was imported under its own environment, so a child may differ from it
only in ``PARAMSERVE_*`` variables, which paramserve reads when it runs, never torch when it
loads (``zygote_key``); ``shared_zygote`` keeps one zygote per other environment.

The caller sees each child as a ``PreloadedProcess``: ``subprocess.Popen``'s pid, poll, wait,
returncode and stdin. The zygote reports an exit without reaping the child (``waitid`` with
WNOWAIT) and reaps it when the caller has seen the exit: as with Popen, a pid is never reused
while its caller may still signal it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn

__all__ = ["PRELOADED_MODULES", "PreloadedProcess", "Zygote", "ZygoteError", "shared_zygote", "zygote_key"]

log = logging.getLogger(__name__)

PRELOADED_MODULES = ("numpy", "torch", "paramserve.psserver.store.optimizer")
"""What the zygote imports before it forks: the slow imports every server and worker makes,
none of which starts threads or opens connections a fork would break."""
WARM_UP = ("paramserve.psserver.store.optimizer", "warm_up")
"""Then it runs this function of a preloaded module: the one optimizer step after which torch has
imported what it imports lazily (about as long again as ``import torch``), which every server
runs before it serves. Named, not imported: the zygote is runtime every process runs on, and
knows no server module by import."""
RUNTIME_ENV_PREFIX = "PARAMSERVE_"
"""Variables a child may set differently from its zygote: read by paramserve as it runs."""
READY_SECONDS = 120.0
"""How long a zygote may take to import torch and say it is ready (a loaded 2-core machine
takes several seconds)."""
REPLY_SECONDS = 30.0
"""How long a fork may take to be answered."""
MAX_MESSAGE_BYTES = 1 << 20
"""A request carries an environment and an argv: far below this."""
MAX_SHARED = 3
"""Zygotes ``shared_zygote`` keeps (one per environment): beyond it, the least recently used
with no child running are closed."""
_REAP_POLL_SECONDS = 1.0
"""The zygote looks for exited children this often even without a SIGCHLD (a safety net)."""


class ZygoteError(RuntimeError):
    """The zygote is gone or refused a start: start the process the ordinary way instead."""


def zygote_key(env: Mapping[str, str], cwd: str) -> tuple[str, str, frozenset[tuple[str, str]]]:
    """What a child must share with its zygote: the interpreter, the directory ``python -m``
    puts first on sys.path, and every variable but paramserve's own (PYTHON*, OMP_*, MKL_*,
    CUDA_*, LD_* and the rest can change what an import does)."""
    kept = frozenset((name, value) for name, value in env.items() if not name.startswith(RUNTIME_ENV_PREFIX))
    return sys.executable, cwd, kept


# ---------------------------------------------------------------- the caller's side


class PreloadedProcess:
    """A child forked by a zygote, seen as ``subprocess.Popen`` sees its child: ``pid``,
    ``stdin`` (the write end of its stdin pipe), ``returncode`` (negative: the signal that
    killed it), ``poll()`` and ``wait(timeout)``. As with Popen, ``returncode`` is set only once
    the child is reaped, so ``kill(pid, 0)`` fails from then on."""

    def __init__(self, pid: int, stdin: IO[bytes], args: Sequence[str], release: Callable[[int], bool]):
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.args = list(args)
        self.returncode: int | None = None
        self._release = release
        self._exit_code: int | None = None
        self._exited = threading.Event()
        self._reaped = threading.Event()
        self._collect_lock = threading.Lock()
        self._released = False

    def poll(self) -> int | None:
        if self.returncode is None and self._exited.is_set():
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        """Has the zygote reap the exited child, then takes its exit code."""
        with self._collect_lock:
            if self.returncode is not None:
                return
            if not self._released:
                self._released = True
                if not self._release(self.pid):
                    self._reaped.set()  # the zygote is gone: init reaps it
            if not self._reaped.wait(REPLY_SECONDS):
                log.warning("the zygote did not reap pid %d within %gs", self.pid, REPLY_SECONDS)
            self.returncode = self._exit_code

    def _exit(self, code: int) -> None:
        """The zygote saw it exit (a zombie there until released)."""
        self._exit_code = code
        self._exited.set()


class Zygote:
    """One zygote process, started by ``start()``, and the connection to it. ``spawn`` forks a
    child from it; raises ZygoteError when the zygote is gone."""

    def __init__(self, env: Mapping[str, str], cwd: str | None = None):
        self._env = dict(env)
        self._cwd = cwd or os.getcwd()
        self.key = zygote_key(self._env, self._cwd)
        """What a child's environment must match (``zygote_key``)."""
        self._socket: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._send_lock = threading.Lock()
        self._spawn_lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._reply_ready = threading.Condition()
        self._children: dict[int, PreloadedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._broken: str | None = None
        self._closing = False

    @property
    def alive(self) -> bool:
        return self._socket is not None and self._broken is None

    @property
    def idle(self) -> bool:
        """No child of its is running (closing it would leave none unwatched)."""
        with self._reply_ready:
            return not self._children

    def start(self, timeout: float = READY_SECONDS) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from paramserve.psserver.runtime.zygote import main; main()",
                    str(theirs.fileno()),
                ],
                pass_fds=[theirs.fileno()],
                env=self._env,
                cwd=self._cwd,
                stdin=subprocess.DEVNULL,
                # Its own session: a Ctrl-C meant for the caller reaches the caller, which stops
                # the children; the zygote ends when the caller's end of the socket closes.
                start_new_session=True,
            )
        except OSError as err:
            ours.close()
            raise ZygoteError(f"could not start the zygote: {err}") from None
        finally:
            theirs.close()
        self._socket = ours
        ours.settimeout(timeout)
        try:
            ready, _ = _receive(ours)
        except OSError as err:
            self.close()
            raise ZygoteError(f"the zygote did not start within {timeout:g}s: {err}") from None
        if ready is None or "ready" not in ready:
            self.close()
            why = ready["refused"] if ready and "refused" in ready else f"exit code {self._process.wait()}"
            raise ZygoteError(f"the zygote failed to start: {why}")
        ours.settimeout(None)
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str], output: IO[bytes]) -> PreloadedProcess:
        """Forks ``python -m module *args`` with ``env`` (differing from the zygote's only in
        PARAMSERVE_* variables), stdout and stderr to ``output`` and a new stdin pipe, in a
        session of its own."""
        if zygote_key(env, self._cwd) != self.key:
            raise ZygoteError("the environment differs from the zygote's beyond PARAMSERVE_* variables")
        read_end, write_end = os.pipe()
        try:
            order = {"op": "spawn", "module": module, "args": list(args), "env": dict(env), "cwd": self._cwd}
            with self._spawn_lock:
                self._send(order, [read_end, output.fileno()])
                reply = self._next_reply()
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        if "pid" not in reply:
            os.close(write_end)
            raise ZygoteError(f"the zygote refused the start: {reply.get('refused', reply)}")
        pid = int(reply["pid"])
        child = PreloadedProcess(pid, os.fdopen(write_end, "wb"), [sys.executable, "-m", module, *args], self._release)
        with self._reply_ready:
            self._children[pid] = child
            early = self._early_exits.pop(pid, None)
        if early is not None:
            child._exit(early)
        return child

    def close(self) -> None:
        """Closes the connection: the zygote exits. Children still running are no longer watched
        (their exits are not reported); they run on until their stdin closes."""
        self._closing = True
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _send(self, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
        if self._socket is None or self._broken is not None:
            raise ZygoteError(f"the zygote is gone: {self._broken or 'not started'}")
        data = json.dumps(message).encode()
        with self._send_lock:
            try:
                if fds:
                    socket.send_fds(self._socket, [data], list(fds))
                else:
                    self._socket.send(data)
            except OSError as err:
                raise ZygoteError(f"the zygote is gone: {err}") from None

    def _next_reply(self) -> dict[str, Any]:
        with self._reply_ready:
            if not self._reply_ready.wait_for(lambda: self._replies or self._broken, REPLY_SECONDS):
                raise ZygoteError(f"the zygote did not answer within {REPLY_SECONDS:g}s")
            if not self._replies:
                raise ZygoteError(f"the zygote is gone: {self._broken}")
            return self._replies.pop(0)

    def _release(self, pid: int) -> bool:
        """Asks the zygote to reap ``pid`` (it answers ``reaped``); False when it is gone."""
        try:
            self._send({"op": "release", "pid": pid})
        except ZygoteError:
            return False
        return True

    def _read(self) -> None:
        """The reader thread: start replies go to the starter, exits to their children."""
        assert self._socket is not None
        while True:
            try:
                message, _ = _receive(self._socket)
            except OSError as err:
                message, reason = None, str(err)
            else:
                reason = "it exited"
            if message is None:
                self._lose(reason)
                return
            if "exited" in message:
                self._on_exit(int(message["exited"]), int(message["code"]))
            elif "reaped" in message:
                with self._reply_ready:
                    reaped = self._children.pop(int(message["reaped"]), None)
                if reaped is not None:
                    reaped._reaped.set()
            else:
                with self._reply_ready:
                    self._replies.append(message)
                    self._reply_ready.notify_all()

    def _on_exit(self, pid: int, code: int) -> None:
        with self._reply_ready:
            child = self._children.get(pid)
            if child is None:  # its start's reply is not yet taken
                self._early_exits[pid] = code
                return
        child._exit(code)

    def _lose(self, reason: str) -> None:
        """The zygote is gone: nothing can report its children's exits any more, so those still
        running are stopped (SIGKILL to their sessions) and count as killed, unless the zygote
        was closed on purpose (then they run on, unwatched). Init reaps them all."""
        with self._reply_ready:
            self._broken = reason
            orphans, self._children = list(self._children.values()), {}
            self._reply_ready.notify_all()
        running = [child for child in orphans if not child._exited.is_set()]
        if running and not self._closing:
            log.error("the zygote is gone (%s): stopping its %d running children", reason, len(running))
            for child in running:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)
                child._exit(-signal.SIGKILL)
        for child in orphans:
            child._reaped.set()


_shared: OrderedDict[tuple[str, str, frozenset[tuple[str, str]]], Zygote] = OrderedDict()
_shared_lock = threading.Lock()


def shared_zygote(env: Mapping[str, str]) -> Zygote:
    """This process's zygote for ``env`` (see ``zygote_key``), started on first use and kept
    until the process exits. Raises ZygoteError when it cannot start."""
    cwd = os.getcwd()
    key = zygote_key(env, cwd)
    with _shared_lock:
        zygote = _shared.get(key)
        if zygote is not None and zygote.alive:
            _shared.move_to_end(key)
            return zygote
        if zygote is not None:
            del _shared[key]
        zygote = Zygote(env, cwd)
        zygote.start()
        _shared[key] = zygote
        for old_key in [k for k, z in _shared.items() if z.idle and k != key][: max(0, len(_shared) - MAX_SHARED)]:
            _shared.pop(old_key).close()
        return zygote


@atexit.register
def _close_shared() -> None:
    with _shared_lock:
        zygotes = list(_shared.values())
        _shared.clear()
    for zygote in zygotes:
        zygote.close()


# ---------------------------------------------------------------- the zygote's side


@dataclass
class _Order:
    """A fork's instructions, as the child runs them."""

    module: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    stdin: int
    output: int


def main() -> None:
    """The zygote: imports PRELOADED_MODULES, then forks a child per request on the socket
    (whose fd is argv[1]) until the caller closes it. Returns in a child, running its module."""
    control = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    threads = _thread_count()
    module, function = WARM_UP
    getattr(importlib.import_module(module), function)()
    if _thread_count() != threads:  # e.g. an OpenMP pool, which a forked child could not use
        _send_message(control, {"refused": f"warming up started threads ({threads} -> {_thread_count()})"})
        os._exit(1)
    _send_message(control, {"ready": os.getpid()})
    order = _serve(control)
    if order is None:
        os._exit(0)  # the caller is gone; nothing here to flush, and torch's teardown takes a second
    _run(order)


def _serve(control: socket.socket) -> _Order | None:
    """The zygote's loop. Returns None when the caller is gone, an order in each child."""
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write.fileno())
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    running: set[int] = set()
    reported: set[int] = set()
    while True:
        for key, _ in selector.select(_REAP_POLL_SECONDS):
            if key.fileobj is wake_read:
                with contextlib.suppress(BlockingIOError):
                    while wake_read.recv(4096):
                        pass
                continue
            message, fds = _receive(control)
            if message is None:
                return None
            if message.get("op") == "release":
                _reap(control, int(message["pid"]), reported)
            elif message.get("op") == "spawn":
                pid = _fork(message, fds, control)
                if pid == 0:
                    selector.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    wake_read.close()
                    wake_write.close()
                    control.close()
                    return _Order(message["module"], message["args"], message["env"], message["cwd"], fds[0], fds[1])
                if pid > 0:
                    running.add(pid)
            else:
                for fd in fds:
                    os.close(fd)
        _report_exits(control, running, reported)


def _fork(message: dict[str, Any], fds: list[int], control: socket.socket) -> int:
    """Forks for a spawn request; the parent answers with the pid (or why not) and closes its
    copies of the child's fds. Returns the pid, 0 in the child, -1 when refused."""
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        _send_message(control, {"refused": f"a start needs 2 file descriptors, got {len(fds)}"})
        return -1
    try:
        pid = os.fork()
    except OSError as err:
        pid, problem = -1, str(err)
    if pid == 0:
        return 0
    for fd in fds:
        os.close(fd)
    _send_message(control, {"pid": pid} if pid > 0 else {"refused": f"fork failed: {problem}"})
    return pid


def _report_exits(control: socket.socket, running: set[int], reported: set[int]) -> None:
    """Tells the caller of each child that exited, leaving it unreaped (its pid stays taken)."""
    for pid in list(running):
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
            running.discard(pid)
        if info is None:
            continue
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        running.discard(pid)
        reported.add(pid)
        _send_message(control, {"exited": pid, "code": code})


def _reap(control: socket.socket, pid: int, reported: set[int]) -> None:
    """Reaps a child whose exit was reported, and says so."""
    if pid in reported:
        reported.discard(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    _send_message(control, {"reaped": pid})


def _run(order: _Order) -> None:
    """In the child: become what ``python -m module args`` would be, then run the module."""
    import runpy

    import setproctitle

    # What ps, top and pgrep -f show: the command a fresh interpreter would have had (Linux keeps
    # the zygote's own otherwise). First: it makes room in the environment block the process
    # started with, which it finds only while the environment is unchanged.
    setproctitle.setproctitle(" ".join([sys.executable, "-m", order.module, *order.args]))
    os.setsid()
    os.dup2(order.stdin, 0)
    os.dup2(order.output, 1)
    os.dup2(order.output, 2)
    os.close(order.stdin)
    os.close(order.output)
    os.chdir(order.cwd)
    os.environ.clear()
    os.environ.update(order.env)
    sys.path[0] = order.cwd  # as `python -m` puts it (the zygote ran with -c: '')
    _reseed()
    sys.argv = [order.module, *order.args]
    try:
        runpy.run_module(order.module, run_name="__main__", alter_sys=True)
    except SystemExit as finished:
        _exit_quickly(finished.code)
    _exit_quickly(0)


def _exit_quickly(code: object) -> NoReturn:
    """What an interpreter's exit does that a program can see: wait for non-daemon threads, run
    the atexit functions (logging flushes its handlers there), flush stdout and stderr, exit with
    ``sys.exit``'s code. Then it skips the rest: tearing down every module the zygote loaded
    (torch's own and the ones it imports at the first optimizer step) takes a forked worker about
    half a second more than a fresh one's exit."""
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status & 0xFF)


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _reseed() -> None:
    """Each child's own random streams: a fork copies the zygote's (``random`` reseeds itself
    after a fork; numpy's global generator does not). torch's default generator starts from the
    same fixed seed in every fresh process, so it is left as it is."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _send_message(sock: socket.socket, message: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the caller is gone: the loop sees it next
        sock.send(json.dumps(message).encode())


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the fds sent with it; (None, []) when the other side closed."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds
