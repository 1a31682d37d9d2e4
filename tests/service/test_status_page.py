"""The status page's HTTP layer on a real server bound to port 0: what it serves, what it
refuses, who may read it, and that its threads end with it (and with the coordinator)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
from grpc import StatusCode

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.commands import status as status_command
from paramserve.coordinator.dispatch.worker_transport import RpcFailure
from paramserve.coordinator.status.cluster_status import RunLog, ServerReading, status_key
from paramserve.coordinator.status.status_page import (
    SAMPLER_THREAD,
    SERVER_THREAD,
    StatusPage,
    StatusSources,
    check_status_exposure,
)
from paramserve.psserver.protocol.errors import ConfigurationError
from paramserve.psserver.protocol.types import ClusterContext

TOKEN = "status-page-token-0123456789"


class FakeProbes:
    def __init__(self) -> None:
        self.closed = False
        self.calls = threading.Semaphore(0)

    def __call__(self) -> list[ServerReading]:
        self.calls.release()
        return [ServerReading("ps:1", "inc-1", True, {"w/0": 4}, 1024)]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def page():
    run = RunLog()
    for i in range(3):
        run.worker_state(f"127.0.0.1:{7000 + i}", "up")
    probes = FakeProbes()
    sources = StatusSources(
        run=run,
        queued=lambda: 5,
        running=lambda: {"127.0.0.1:7000": 1},
        in_flight=lambda: 1,
        checkpoint=lambda: None,
        parameter_servers=("ps:1",),
        probe_servers=probes,
    )
    served = StatusPage(sources, key=status_key(TOKEN), interval=0.05, probe_every=1)
    served.start("127.0.0.1", 0)
    served.probes = probes  # type: ignore[attr-defined]
    served.run = run  # type: ignore[attr-defined]
    yield served
    served.stop(10)


def get(page: StatusPage, path: str, headers: dict[str, str] | None = None, method: str = "GET"):
    connection = http.client.HTTPConnection("127.0.0.1", page.port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        reply = connection.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        connection.close()


def test_the_page_and_its_json_need_the_key_and_show_the_cluster(page):
    key = status_key(TOKEN)
    assert get(page, "/status.json")[0] == 401
    assert get(page, "/status.json?key=wrong")[0] == 401
    code, headers, body = get(page, f"/status.json?key={key}")
    assert code == 200 and headers["Content-Type"] == "application/json"
    status = json.loads(body)
    assert [w["address"] for w in status["workers"]] == [f"127.0.0.1:{7000 + i}" for i in range(3)]
    assert status["summary"]["closures"]["queued"] == 5
    assert get(page, "/status.json", {"Authorization": f"Bearer {key}"})[0] == 200
    code, headers, body = get(page, f"/?key={key}")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'sha256-" in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store" and headers["Referrer-Policy"] == "no-referrer"
    assert body.count(b'data-state="alive"') == 3
    assert page.url == f"http://127.0.0.1:{page.port}/?key={key}"


def test_the_sampler_probes_the_servers_and_the_rows_show_them(page):
    key = status_key(TOKEN)
    assert page.probes.calls.acquire(timeout=10) and page.probes.calls.acquire(timeout=10)
    status = json.loads(get(page, f"/status.json?key={key}")[2])
    assert status["servers"][0]["state"] == "serving" and status["servers"][0]["bytes"] == 1024
    assert len(status["series"]["t"]) >= 1


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [("GET", "/nope", 404), ("GET", "/../etc/passwd", 404), ("POST", "/", 405), ("DELETE", "/status.json", 405)],
)
def test_bad_requests_get_404_or_405_and_the_page_keeps_serving(page, method, path, code):
    answer = get(page, path, method=method)
    assert answer[0] == code
    if code == 405:
        assert answer[1]["Allow"] == "GET"
    with socket.create_connection(("127.0.0.1", page.port), timeout=10) as raw:
        raw.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")  # e.g. a TLS hello: the line is no request
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
        assert b"Error code: 400" in reply
    assert get(page, f"/status.json?key={status_key(TOKEN)}")[0] == 200


def test_a_request_over_the_size_limit_is_413_and_the_page_keeps_serving(page):
    with socket.create_connection(("127.0.0.1", page.port), timeout=10) as raw:
        raw.sendall(b"GET /" + b"a" * 16380)  # 16,385 bytes and no end of the headers yet: refused
        reply = b"".join(iter(lambda: raw.recv(4096), b""))
    assert reply.startswith(b"HTTP/1.0 413 ")
    assert get(page, f"/status.json?key={status_key(TOKEN)}")[0] == 200


def test_a_reader_with_a_cursor_gets_only_what_it_lacks(page):
    key = status_key(TOKEN)
    assert page.probes.calls.acquire(timeout=10) and page.probes.calls.acquire(timeout=10)
    whole = json.loads(get(page, f"/status.json?key={key}")[2])
    assert whole["since"] is None and whole["series"]["keep"] == 0 and len(whole["events"]) == 3
    page.sample()
    page.run.worker_state("127.0.0.1:7009", "up")
    code, _, body = get(page, f"/status.json?key={key}&since={whole['cursor']}")
    part = json.loads(body)
    assert code == 200 and part["since"] == whole["cursor"] and part["cursor"] != whole["cursor"]
    assert [e["subject"] for e in part["events"]] == ["127.0.0.1:7009"], "only the new event"
    assert part["series"]["keep"] == len(whole["series"]["t"]) and len(part["series"]["t"]) >= 1
    assert len(part["workers"]) == 4, "the tables come whole"
    other_run = "0" + whole["cursor"]  # a cursor of another page (a restarted coordinator)
    again = json.loads(get(page, f"/status.json?key={key}&since={other_run}")[2])
    assert again["since"] is None and len(again["events"]) == 4, "the whole status"


@pytest.mark.parametrize("since", ["", "nope", "1.2.3", "%00", "a.0.0.0&since=a.0.0.0", "9.9.9." + "9" * 30])
def test_a_since_that_is_no_cursor_is_400_naming_it_and_the_page_keeps_serving(page, since):
    key = status_key(TOKEN)
    assert get(page, f"/status.json?since={since}")[0] == 401, "the key first"
    code, headers, body = get(page, f"/status.json?key={key}&since={since}")
    assert code == 400 and headers["Content-Type"].startswith("text/plain")
    assert body.startswith(b"since= ") and b"cursor" in body
    assert get(page, f"/status.json?key={key}")[0] == 200


def test_paramserve_status_prints_the_page_s_facts(page, capsys, monkeypatch):
    monkeypatch.setenv("PARAMSERVE_TOKEN", TOKEN)
    parser = status_command.build_parser()
    assert status_command.main(parser.parse_args([f"127.0.0.1:{page.port}"]), parser) == 0
    out = capsys.readouterr().out
    assert "workers: 3 (3 alive" in out and "127.0.0.1:7002" in out
    monkeypatch.delenv("PARAMSERVE_TOKEN")
    assert status_command.main(parser.parse_args([f"127.0.0.1:{page.port}"]), parser) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert status_command.main(parser.parse_args([page.url, "--json"]), parser) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == 1


def test_stopping_the_page_leaves_none_of_its_threads(page):
    names = {t.name for t in threading.enumerate()}
    assert {SAMPLER_THREAD, SERVER_THREAD} <= names
    get(page, "/nope")
    assert page.stop(10)
    assert page.probes.closed
    left = [t.name for t in threading.enumerate() if t.name.startswith("paramserve-status")]
    assert left == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{page.port}/", timeout=5)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "::"])
def test_beyond_loopback_the_page_needs_the_token(host):
    with pytest.raises(ConfigurationError, match="token.*127.0.0.1"):
        check_status_exposure(host, None)
    check_status_exposure(host, TOKEN)
    check_status_exposure("127.0.0.1", None)


# ---------------------------------------------------------------- on a coordinator


class _Strategy:
    def __init__(self, token: str | None):
        self.cluster = ClusterSpec(parameter_servers=("127.0.0.1:1",), workers=("127.0.0.1:2", "127.0.0.1:3"))
        self.token, self.tls, self.max_value_age, self.overlap_pushes = token, None, 0.0, False
        self.max_row_staleness = 0
        self.sync_dense = None

    def cluster_context(self):
        return ClusterContext(("127.0.0.1:1",))

    def attach_coordinator(self, coordinator):
        return None


class _Unreachable:
    async def run_closures(self, request, timeout):
        raise RpcFailure(StatusCode.UNAVAILABLE.name, "connection refused")

    async def is_serving(self, timeout):
        return False

    async def cancel_closures(self, closure_ids, timeout):
        pass

    async def reset(self):
        pass

    async def close(self):
        pass


def test_a_coordinator_serves_its_page_and_shutdown_stops_every_thread_of_it():
    coordinator = ClusterCoordinator(_Strategy(None), transport_factory=lambda a: _Unreachable(), status_port=0)
    try:
        url = coordinator.status_url
        assert url is not None and "key=" not in url
        status = json.loads(urllib.request.urlopen(url + "status.json", timeout=10).read())
        assert {w["address"] for w in status["workers"]} == {"127.0.0.1:2", "127.0.0.1:3"}
        coordinator.report(3, loss=0.5)
        status = json.loads(urllib.request.urlopen(url + "status.json", timeout=10).read())
        assert status["summary"]["step"] == 3 and status["summary"]["loss"] == 0.5
    finally:
        coordinator.shutdown()
    assert [t.name for t in threading.enumerate() if t.name.startswith("paramserve-status")] == []
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_a_coordinator_refuses_to_serve_its_page_beyond_loopback_without_a_token():
    with pytest.raises(ConfigurationError, match="status page on 0.0.0.0"):
        ClusterCoordinator(
            _Strategy(None), transport_factory=lambda a: _Unreachable(), status_port=0, status_host="0.0.0.0"
        )
    with ClusterCoordinator(
        _Strategy(TOKEN), transport_factory=lambda a: _Unreachable(), status_port=0, status_host="0.0.0.0"
    ) as coordinator:
        url = coordinator.status_url
        assert url is not None and f"key={status_key(TOKEN)}" in url
        port = url.split(":")[2].split("/")[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10)
        assert refused.value.code == 401
