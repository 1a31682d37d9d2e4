"""Issue 20: the data plane tried as an attacker and a flaky network would, against real servers:
a listener that never dies, handshakes with a deadline and a budget of their own, mutual and
non-replayable authentication, bounds after authentication, and a trace of every refusal. Each
test reproduces one finding of the issue, and the server stays up for everyone else."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import ssl
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_dataplane_transport import (
    SGD,
    TOKEN,
    closed_by_peer,
    connect,
    error_of,
    frame,
    read_frame,
    steps_on_data_plane,
    still_serves,
)

from paramserve.psserver.dataplane import dataplane_client, dataplane_server
from paramserve.psserver.dataplane.frames import MAGIC, PREFIX, FrameKind
from paramserve.psserver.protocol.errors import AuthenticationError, InvalidRequestError
from paramserve.psserver.runtime.security import DataPlaneKey, TlsConfig, new_handshake_nonce
from paramserve.psserver.server import DATA_PLANE_HEALTH
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from tests.certificates import Certificates, make_certificates, needs_openssl

DEADLINE = 20.0


@pytest.fixture
def clients():  # type: ignore[no-untyped-def]
    """Clients with the default configuration: on the data plane where they can be."""
    from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient

    made: list[ParameterServerClient] = []

    def make(addresses: list[str], **overrides: object) -> ParameterServerClient:
        made.append(
            ParameterServerClient(
                addresses, ClientConfig(**{"call_timeout": 10.0, "retry_deadline": 10.0, **overrides})
            )
        )  # type: ignore[arg-type]
        return made[-1]

    yield make
    for client in made:
        client.close()


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        return placeholder.getsockname()[1]


def scraped(metrics_port: int, name: str, labels: str) -> float:
    """One sample of a server process's Prometheus endpoint (0 when absent)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    line = next((l for l in text.splitlines() if l.startswith(f"{name}{{") and labels in l), None)  # noqa: E741
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def data_plane_info(address: str) -> ps_pb2.DataPlaneInfo:
    from paramserve.psserver.protocol.metadata import SERVICE_NAME
    from paramserve.psserver.runtime.security import bearer_metadata

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/GetDataPlane",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=ps_pb2.DataPlaneInfo.FromString,
        )
        return call(ps_pb2.GetDataPlaneRequest(), metadata=[bearer_metadata(TOKEN)], timeout=10)


def refused(server, reason: str) -> float:
    return server.registry.get_sample_value("paramserve_dataplane_refused_total", {"reason": reason}) or 0.0


def wait_until(condition, what: str, deadline: float = DEADLINE) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {deadline:g}s"
        time.sleep(0.02)


def data_plane_health(server) -> int:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=DATA_PLANE_HEALTH), timeout=5
        )
    return reply.status


def handshake(sock: socket.socket, key: DataPlaneKey, client_nonce: bytes) -> tuple[bytes, bytes]:
    """Plays the client's side up to its proof: returns the server's nonce and the proof to send."""
    sock.sendall(frame(FrameKind.HELLO, client_nonce))
    kind, challenge, _ = read_frame(sock)
    assert kind is FrameKind.CHALLENGE
    server_nonce = challenge[:32]
    assert challenge[32:] == key.server_proof(client_nonce, server_nonce), "the server proves it holds the token"
    return server_nonce, key.client_proof(client_nonce, server_nonce)


# ---------------------------------------------------------------- the listener never dies


def test_a_failing_accept_is_counted_retried_and_reported_and_the_listener_goes_on(start_ps, clients, monkeypatch):
    monkeypatch.setattr(dataplane_server, "UNHEALTHY_AFTER_FAILURES", 3)
    failures = {"left": 6}
    accept = socket.socket.accept

    def failing_accept(self):  # type: ignore[no-untyped-def]
        if failures["left"] > 0 and self.family == socket.AF_INET:
            failures["left"] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    server = start_ps(token=TOKEN)
    monkeypatch.setattr(socket.socket, "accept", failing_accept)
    probe = socket.create_connection(("127.0.0.1", server.data_port), timeout=DEADLINE)  # wakes the failing accepts
    wait_until(lambda: data_plane_health(server) == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING")
    wait_until(lambda: failures["left"] == 0, "the accepts to have failed")
    probe.close()
    socket.create_connection(("127.0.0.1", server.data_port), timeout=DEADLINE).close()  # accepted: the loop lives
    wait_until(lambda: data_plane_health(server) == health_pb2.HealthCheckResponse.SERVING, "SERVING again")
    assert refused(server, "accept_failed") >= 3  # each failed round (its shedding accept fails too)
    before = steps_on_data_plane(server)
    still_serves(server, clients, TOKEN)
    assert steps_on_data_plane(server) == before + 1, "on the data plane, which still accepts"


def server_with_descriptor_limit(limit: int) -> list[str]:
    """The command of ``python -m paramserve.psserver`` with a descriptor limit of ``limit``, which
    the child sets itself. Not a preexec_fn: that runs Python in a fork of this process, where
    gRPC's fork handlers restart its poller thread on a descriptor that the fork then closes
    before exec, and the poller aborts the child now and then (SIGABRT, "epoll_wait error: Bad
    file descriptor", before the server ran a line)."""
    module = "paramserve.psserver"
    launcher = (
        f"import resource, runpy; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", launcher]


def test_a_connection_flood_under_a_low_descriptor_limit_never_disables_the_data_plane(tmp_path, clients):
    """The issue's flood: 300 idle unauthenticated connections against a server whose descriptor
    limit is 256. The server caps them (evicting the ones still in their handshake), a correct
    client trains meanwhile, and the data plane serves at once after the flood ends."""
    port_file = tmp_path / "ps.port"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    data_port = free_port()
    server = subprocess.Popen(
        [
            *server_with_descriptor_limit(256),
            "--port",
            "0",
            "--data-port",
            str(data_port),
            "--max-connections",
            "48",
            "--metrics-port",
            "0",
            "--token-file",
            str(token_file),
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "ps.log").open("wb"),
    )
    flood: list[socket.socket] = []
    try:
        wait_until(port_file.exists, "the server to serve", 120)
        ports = json.loads(port_file.read_text())
        address, metrics_port = f"127.0.0.1:{ports['port']}", ports["metrics_port"]
        client = clients([address], token=TOKEN)
        client.create_variable("w", torch.zeros(4), optimizer=SGD)
        for _ in range(300):
            try:
                flood.append(socket.create_connection(("127.0.0.1", data_port), timeout=5))
            except OSError:
                pass
        started = time.monotonic()
        summary, _ = client.push_and_pull({"w": torch.ones(4)}, ["w"], key="during")
        assert summary.applied == 1 and time.monotonic() - started < 15, "a correct client trains during the flood"
        for sock in flood:
            sock.close()
        flood.clear()
        fresh = clients([address], token=TOKEN)
        on_data_plane = 'method="DataPlaneStep"'
        before = scraped(metrics_port, "paramserve_rpcs_total", on_data_plane)
        started = time.monotonic()
        summary, pulled = fresh.push_and_pull({"w": torch.ones(4)}, ["w"], key="after")
        assert summary.applied == 1 and time.monotonic() - started < 5, "served at once after the flood"
        assert torch.equal(pulled.tensors["w"], torch.full((4,), -1.0))
        assert scraped(metrics_port, "paramserve_rpcs_total", on_data_plane) == before + 1, "on the data plane"
        assert scraped(metrics_port, "paramserve_dataplane_refused_total", "") > 0, "the flood was refused"
        assert server.poll() is None
    finally:
        for sock in flood:
            sock.close()
        server.terminate()
        server.wait(30)


def test_more_connections_than_descriptors_refuse_to_start_naming_both(tmp_path):
    done = subprocess.run(
        [*server_with_descriptor_limit(256), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--max-connections 1024 needs" in done.stderr and "256" in done.stderr


# ---------------------------------------------------------------- handshakes: a deadline and a budget


def test_a_trickled_hello_is_dropped_at_the_handshakes_deadline_in_all(start_ps, monkeypatch):
    monkeypatch.setattr(dataplane_server, "HANDSHAKE_SECONDS", 1.0)
    server = start_ps(token=TOKEN)
    sock = connect(server)
    hello = frame(FrameKind.HELLO, new_handshake_nonce())
    started = time.monotonic()
    with pytest.raises(OSError):
        for byte in hello:  # one byte every 0.2 s: each read is quick, the whole is not
            sock.sendall(bytes([byte]))
            time.sleep(0.2)
    assert closed_by_peer(sock) and time.monotonic() - started < 3.0
    assert refused(server, "handshake_timeout") == 1


def test_connections_that_never_authenticate_cannot_crowd_out_real_clients(start_ps, clients):
    server = start_ps(token=TOKEN, max_connections=16)
    silent = [connect(server) for _ in range(16)]
    budget = dataplane_server.max_pending_handshakes(16)
    # Every silent connection accepted (each beyond the budget evicts the oldest), not only the
    # budget full: one still in the listener's backlog would evict the real client's connection
    # while it is in its own handshake (a loaded machine's CI saw it).
    wait_until(
        lambda: server.data_plane.handshaking == budget and refused(server, "handshake_evicted") == 16 - budget,
        "every silent connection accepted, the budget full",
    )
    before = steps_on_data_plane(server)
    still_serves(server, clients, TOKEN)
    assert steps_on_data_plane(server) == before + 1, "on the data plane, admitted at once"
    assert refused(server, "handshake_evicted") >= 1
    for sock in silent:
        sock.close()


def test_a_full_data_plane_sends_steps_over_the_step_rpc_instead(start_ps, clients):
    server = start_ps(token=TOKEN, max_connections=2)
    held = [
        dataplane_client.DataPlaneConnection(
            "127.0.0.1", server.data_port, token=TOKEN, tls=None, timeout=10, max_body_bytes=1 << 20
        )
        for _ in range(2)
    ]
    client = clients([server.address], token=TOKEN)
    client.create_variable("w", torch.zeros(4), optimizer=SGD)
    started = time.monotonic()
    summary, _ = client.push_and_pull({"w": torch.ones(4)}, ["w"], key="k")
    assert summary.applied == 1 and time.monotonic() - started < 5
    assert (
        server.registry.get_sample_value("paramserve_rpcs_total", {"role": "ps", "method": "Step", "code": "OK"}) == 1
    )
    assert refused(server, "connection_limit") >= 1
    for connection in held:
        connection.close()


# ---------------------------------------------------------------- mutual, non-replayable authentication


def test_a_listener_without_the_token_learns_nothing_reusable(start_ps, clients):
    """A process that took the server's address gets a fresh nonce, not a credential: the client
    stops when it cannot prove the token, and what it sent is worthless to the real server."""
    impostor = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve_one() -> None:
        sock, _ = impostor.accept()
        sock.settimeout(5)
        kind, header, _ = read_frame(sock)
        received.append(header)
        fake_nonce = new_handshake_nonce()
        sock.sendall(frame(FrameKind.CHALLENGE, fake_nonce + b"\0" * 32))  # it cannot compute the proof
        try:
            received.append(sock.recv(1024))
        except OSError:
            received.append(b"")
        sock.close()

    thread = threading.Thread(target=serve_one)
    thread.start()
    with pytest.raises(AuthenticationError, match="could not prove it holds the cluster's token"):
        dataplane_client.DataPlaneConnection(
            "127.0.0.1", impostor.getsockname()[1], token=TOKEN, tls=None, timeout=5, max_body_bytes=1 << 20
        )
    thread.join(10)
    impostor.close()
    hello, after_challenge = received
    assert len(hello) == 32 and TOKEN.encode() not in hello, "a random nonce, no credential"
    assert after_challenge == b"", "the client sent nothing after a challenge it could not verify"

    # Replayed to the real server, the captured nonce gets a new challenge no replay can answer.
    server = start_ps(token=TOKEN)
    sock = connect(server)
    sock.sendall(frame(FrameKind.HELLO, hello))
    kind, challenge, _ = read_frame(sock)
    sock.sendall(frame(FrameKind.PROOF, b"\0" * 32))
    kind, header, _ = read_frame(sock)
    assert kind is FrameKind.ERROR and error_of(header).error_type == "AuthenticationError"
    assert refused(server, "wrong_credential") == 1
    still_serves(server, clients, TOKEN)


def test_a_captured_proof_does_not_replay_on_another_connection(start_ps):
    server = start_ps(token=TOKEN)
    key, client_nonce = DataPlaneKey.of(TOKEN), new_handshake_nonce()
    first = connect(server)
    _, proof = handshake(first, key, client_nonce)
    first.sendall(frame(FrameKind.PROOF, proof))
    assert read_frame(first)[0] is FrameKind.WELCOME, "the proof holds on its own connection"
    second = connect(server)
    second.sendall(frame(FrameKind.HELLO, client_nonce))  # the same nonce, replayed
    kind, challenge, _ = read_frame(second)
    assert kind is FrameKind.CHALLENGE and challenge[:32] != b"", "a new server nonce"
    second.sendall(frame(FrameKind.PROOF, proof))
    kind, header, _ = read_frame(second)
    assert kind is FrameKind.ERROR and error_of(header).error_type == "AuthenticationError"
    assert closed_by_peer(second)


def test_the_local_socket_is_used_only_when_its_owner_is_the_server(tmp_path, clients):
    """Another process bound an abstract name and waits there: the client checks the socket's peer
    credentials against the server's pid and uid, speaks no byte to it, and takes TCP."""
    port_file = tmp_path / "ps.port"
    (tmp_path / "token").write_text(TOKEN)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paramserve.psserver",
            "--port",
            "0",
            "--data-port",
            "0",
            "--token-file",
            str(tmp_path / "token"),
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wait_until(port_file.exists, "the server to serve", 120)
        info = data_plane_info(f"127.0.0.1:{json.loads(port_file.read_text())['port']}")
        assert info.server_pid == server.pid and info.server_uid == os.getuid()
        name = "paramserve-dataplane-squatted-" + os.urandom(4).hex()
        squatter.bind(b"\0" + name.encode())
        squatter.listen(4)
        squatter.settimeout(0.5)
        connection = dataplane_client.DataPlaneConnection(
            "127.0.0.1",
            info.port,
            token=TOKEN,
            tls=None,
            timeout=10,
            max_body_bytes=info.max_frame_bytes,
            local_socket=name,
            local_owner=(info.server_pid, info.server_uid),
        )
        assert not connection.local, "the squatted name was refused: TCP"
        peer, _ = squatter.accept()
        peer.settimeout(1)
        assert peer.recv(1024) == b"", "not one byte reached the squatter"
        peer.close()
        connection.close()
        honest = dataplane_client.DataPlaneConnection(
            "127.0.0.1",
            info.port,
            token=TOKEN,
            tls=None,
            timeout=10,
            max_body_bytes=info.max_frame_bytes,
            local_socket=info.local_socket,
            local_owner=(info.server_pid, info.server_uid),
        )
        assert honest.local, "the server's own local socket is taken"
        honest.close()
    finally:
        squatter.close()
        server.terminate()
        server.wait(30)


# ---------------------------------------------------------------- bounds after authentication


def authenticated(server) -> socket.socket:
    sock = connect(server)
    key, nonce = DataPlaneKey.of(TOKEN), new_handshake_nonce()
    _, proof = handshake(sock, key, nonce)
    sock.sendall(frame(FrameKind.PROOF, proof))
    assert read_frame(sock)[0] is FrameKind.WELCOME
    return sock


def test_a_stalled_frame_is_dropped_at_its_deadline(start_ps, clients, monkeypatch):
    monkeypatch.setattr(dataplane_server, "FRAME_SECONDS", 0.5)
    server = start_ps(token=TOKEN)
    sock = authenticated(server)
    sock.sendall(PREFIX.pack(b"PSD1", FrameKind.STEP, 1 << 20, 0) + b"\0" * 10)  # a 1 MiB header, then nothing
    started = time.monotonic()
    assert closed_by_peer(sock) and time.monotonic() - started < 3.0
    assert refused(server, "frame_timeout") == 1
    still_serves(server, clients, TOKEN)


def test_an_oversized_header_is_refused_before_it_is_read(start_ps, clients):
    server = start_ps(token=TOKEN)
    sock = authenticated(server)
    sock.sendall(PREFIX.pack(b"PSD1", FrameKind.STEP, 58_600_000, 0))  # the issue's 58.6 MB plan
    kind, header, _ = read_frame(sock)
    assert kind is FrameKind.ERROR and error_of(header).error_type == "MessageTooLargeError"
    assert refused(server, "oversized_frame") == 1
    still_serves(server, clients, TOKEN)


def test_a_step_program_over_its_byte_budget_is_refused_and_the_client_sends_it_whole(start_ps, clients):
    server = start_ps(token=TOKEN)
    sock = authenticated(server)
    plan = ps_pb2.StepPlan(define_program=1, idempotency_key="k" * (300 << 10))
    sock.sendall(frame(FrameKind.STEP, plan.SerializeToString()))
    kind, header, _ = read_frame(sock)
    assert kind is FrameKind.ERROR and error_of(header).error_type == InvalidRequestError.__name__
    assert "plain StepPlan" in error_of(header).message
    still_serves(server, clients, TOKEN)


# ---------------------------------------------------------------- a trace of every refusal


def test_refusals_are_counted_by_reason_and_logged_at_a_bounded_rate(start_ps, caplog):
    server = start_ps(token=TOKEN)
    caplog.set_level(logging.WARNING, logger="paramserve.psserver.dataplane.dataplane_server")
    for _ in range(30):
        sock = connect(server)
        sock.sendall(frame(FrameKind.HELLO, b"not a nonce"))
        assert read_frame(sock)[0] is FrameKind.ERROR
        sock.close()
    wait_until(lambda: refused(server, "wrong_credential") == 30, "every refusal counted")
    lines = [r for r in caplog.records if "wrong credential" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


def test_framing_attacks_are_refused_counted_by_reason_and_logged(start_ps, clients, caplog):
    """Issue 43: a frame before the handshake, a second HELLO, or bytes that are no frame were
    dropped without a count or a line."""
    server = start_ps(token=TOKEN)
    caplog.set_level(logging.WARNING, logger="paramserve.psserver.dataplane.dataplane_server")
    attacks = [
        (frame(FrameKind.STEP, b"a plan"), "unexpected_frame"),  # a STEP before HELLO
        (frame(FrameKind.PROOF, b"\0" * 32), "unexpected_frame"),  # a PROOF before HELLO
        (b"GET / HTTP/1.1\r\nHost: paramserve\r\n\r\n", "malformed_frame"),  # not a frame
        (PREFIX.pack(MAGIC, 99, 0, 0), "malformed_frame"),  # a kind that does not exist
    ]
    for data, _ in attacks:
        for _ in range(3):
            with connect(server) as sock:
                sock.sendall(data)
                assert closed_by_peer(sock)
    with authenticated(server) as sock:
        sock.sendall(frame(FrameKind.HELLO, new_handshake_nonce()))  # a second HELLO
        assert closed_by_peer(sock)
    counts = {"unexpected_frame": 7, "malformed_frame": 6}
    wait_until(lambda: all(refused(server, reason) == n for reason, n in counts.items()), f"counted: {counts}")
    for reason in counts:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().endswith(f"[{reason}]")]
        assert 1 <= len(lines) <= 2, lines  # at most one a reason every LOG_EVERY_SECONDS
    still_serves(server, clients, TOKEN)


# ---------------------------------------------------------------- TLS: the same deadline and budget

SLACK = 2.0
"""How late past a deadline a close may come: the reaper wakes every 0.25 s, on a shared machine."""


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def start_tls(start_ps, certificates: Certificates, mutual: bool, **overrides: object):  # type: ignore[no-untyped-def]
    tls = TlsConfig(certificates.cert, certificates.key, certificates.ca if mutual else None)
    return start_ps(token=TOKEN, tls=tls, **overrides)


def tls_clients(clients, certificates: Certificates, mutual: bool):  # type: ignore[no-untyped-def]
    """Clients of a TLS server, presenting a certificate where the server asks for one (mutual),
    as a user configures them."""
    mine = {"tls_cert_chain": certificates.cert, "tls_private_key": certificates.key} if mutual else {}

    def make(addresses: list[str], **overrides: object):  # type: ignore[no-untyped-def]
        return clients(addresses, tls_root_certificates=certificates.ca, **mine, **overrides)

    return make


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (a TLS server sends nothing before the client's
    whole hello); None when it was still open ``seconds`` later."""
    started = time.monotonic()
    if not select.select([sock], [], [], seconds)[0]:
        return None
    return time.monotonic() - started if closed_by_peer(sock) else None


def client_hello(certificates: Certificates) -> bytes:
    """The first flight of a real TLS client: its ClientHello."""
    context = ssl.create_default_context(cafile=str(certificates.ca))
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def trickle(sock: socket.socket, data: bytes, every: float, seconds: float) -> float | None:
    """Sends ``data`` a byte every ``every`` seconds until the server closes ``sock``: the seconds
    that took, None when it was still open ``seconds`` later (or had the whole of ``data``)."""
    started = time.monotonic()
    for byte in data:
        if time.monotonic() - started > seconds:
            return None
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return time.monotonic() - started
        if select.select([sock], [], [], every)[0]:  # readable: closed (nothing else comes before the hello)
            return time.monotonic() - started if closed_by_peer(sock) else None
    return None


@needs_openssl
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_silent_tls_connections_are_closed_at_the_handshakes_deadline_and_counted_once(
    start_ps, clients, certificates, monkeypatch, mutual
):
    """Issue 43: silent TLS connections were open 24 s later, each holding a thread and a slot,
    and the reaper counted each again every 0.25 s: ``wrap_socket`` had moved the descriptor to
    an object the reaper never saw."""
    monkeypatch.setattr(dataplane_server, "HANDSHAKE_SECONDS", 1.0)
    server = start_tls(start_ps, certificates, mutual)
    silent = [connect(server) for _ in range(3)]
    for sock in silent:
        assert closed_within(sock, 1.0 + SLACK) is not None, "a silent TLS connection outlived its deadline"
        sock.close()
    wait_until(lambda: server.data_plane.connections == 0, "their threads and slots given back", SLACK)
    wait_until(lambda: refused(server, "handshake_timeout") == 3, "each counted")
    with connect(server) as late:  # another deadline passes: the reaper runs four rounds meanwhile
        assert closed_within(late, 1.0 + SLACK) is not None
    wait_until(lambda: refused(server, "handshake_timeout") == 4, "the last one counted")
    assert refused(server, "handshake_timeout") == 4, "none counted twice"
    before = steps_on_data_plane(server)
    still_serves(server, tls_clients(clients, certificates, mutual), TOKEN)
    assert steps_on_data_plane(server) == before + 1, "over TLS on the data plane"


@needs_openssl
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_a_trickled_tls_handshake_is_closed_at_its_deadline(start_ps, certificates, monkeypatch, mutual):
    """Issue 43: a ClientHello a byte at a time held its connection for as long as it trickled."""
    monkeypatch.setattr(dataplane_server, "HANDSHAKE_SECONDS", 1.0)
    server = start_tls(start_ps, certificates, mutual)
    with connect(server) as sock:
        took = trickle(sock, client_hello(certificates), every=0.05, seconds=1.0 + SLACK)
    assert took is not None, "a trickled TLS handshake outlived its deadline"
    assert took >= 0.8, f"closed after {took:.2f}s, before its deadline"
    wait_until(lambda: server.data_plane.connections == 0, "its thread and slot given back", SLACK)
    wait_until(lambda: refused(server, "handshake_timeout") == 1, "counted")


@needs_openssl
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_connections_still_in_their_handshake_are_evicted_for_newcomers(start_ps, clients, certificates, mutual):
    """Issue 43: the evictor closed a detached socket, so an evicted TLS connection kept its
    thread and its slot until its peer left."""
    server = start_tls(start_ps, certificates, mutual, max_connections=8)  # 2 may be in their handshake
    first = connect(server)
    wait_until(lambda: server.data_plane.handshaking == 1, "the first in its handshake")
    others = [connect(server) for _ in range(2)]
    assert closed_within(first, SLACK) is not None, "the oldest handshake was not dropped for a newcomer"
    assert refused(server, "handshake_evicted") >= 1
    before = steps_on_data_plane(server)
    still_serves(server, tls_clients(clients, certificates, mutual), TOKEN)
    assert steps_on_data_plane(server) == before + 1, "over TLS on the data plane, admitted at once"
    for sock in [first, *others]:
        sock.close()


@needs_openssl
def test_only_a_connections_own_thread_closes_its_descriptor(start_ps, certificates, monkeypatch):
    """CI failure: the evictor and the reaper closed a TLS connection's descriptor while its
    thread was still in OpenSSL's handshake, whose BIO keeps the number; a client opening its CA
    file got that number, the handshake read the file, and the client found no certificate in
    what was left ("Could not load any root certificate"). Other threads now shut a connection
    down (which wakes its thread and tells the peer); only its own thread closes it."""
    closers: list[str] = []
    close = dataplane_server.close_socket

    def recording(sock: socket.socket) -> None:
        if sock.type == socket.SOCK_STREAM and sock.fileno() >= 0 and not _listening(sock):
            closers.append(threading.current_thread().name)
        close(sock)

    monkeypatch.setattr(dataplane_server, "close_socket", recording)
    monkeypatch.setattr(dataplane_server, "HANDSHAKE_SECONDS", 1.0)
    server = start_tls(start_ps, certificates, False, max_connections=8)  # 2 may be in their handshake
    first = connect(server)
    wait_until(lambda: server.data_plane.handshaking == 1, "the first in its handshake")
    others = [connect(server) for _ in range(2)]  # the first evicted for these; they time out
    assert closed_within(first, SLACK) is not None, "the oldest handshake was not dropped"
    for sock in others:
        assert closed_within(sock, 1.0 + SLACK) is not None, "a silent TLS connection outlived its deadline"
    wait_until(lambda: server.data_plane.connections == 0, "their threads and slots given back", SLACK)
    assert refused(server, "handshake_evicted") >= 1 and refused(server, "handshake_timeout") >= 1
    assert len(closers) == 3, closers
    assert set(closers) == {"paramserve-dataplane"}, f"closed by {closers}: only a connection's thread may"
    for sock in [first, *others]:
        sock.close()


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


@needs_openssl
def test_a_failed_tls_handshake_is_counted(start_ps, certificates):
    server = start_tls(start_ps, certificates, mutual=True)
    with connect(server) as sock:
        sock.sendall(frame(FrameKind.HELLO, new_handshake_nonce()))  # plaintext on a TLS port
        assert closed_by_peer(sock)
    context = ssl.create_default_context(cafile=str(certificates.ca))  # TLS, but no client certificate
    with connect(server) as sock:
        try:
            with context.wrap_socket(sock, server_hostname="localhost") as tls:
                assert tls.recv(1) == b""
        except OSError:
            pass  # refused: the server's alert
    wait_until(lambda: refused(server, "tls_failed") == 2, "both counted")
