"""``paramserve status ADDRESS``: what the coordinator's status page shows, in the terminal.

For machines without a browser. ADDRESS is where the page listens: ``host:port``, or the page's
whole address as ``paramserve demo`` and ``ClusterCoordinator.status_url`` give it
(``http://host:port/?key=...``). A cluster with a token asks for the page's key: in the address,
or derived here from the token (``--token-file``, else PARAMSERVE_TOKEN). Exit status 0 when the
page answered, 1 when it could not be reached or refused.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from paramserve.coordinator.status.cluster_status import bytes_text, status_key
from paramserve.psserver.runtime.security import TOKEN_ENV, check_token, read_token_file

__all__ = ["build_parser", "fetch_status", "format_status", "main", "status_request"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve status", description=__doc__)
    parser.add_argument("address", help="host:port of the status page, or its whole address (http://...?key=...)")
    parser.add_argument(
        "--token-file", type=pathlib.Path, help="the cluster's token, to derive the page's key (else PARAMSERVE_TOKEN)"
    )
    parser.add_argument("--events", type=int, default=10, help="newest events to print (default: %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the page (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the status as JSON (what /status.json serves)")
    return parser


def status_request(address: str, token: str | None) -> urllib.request.Request:
    """The request for ``/status.json`` at ``address`` (``host:port`` or a URL, its ``key`` kept),
    with the key derived from ``token`` unless the address carries one."""
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}/")
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"{address!r} is not host:port nor an http:// address")
    query = urllib.parse.parse_qs(url.query)
    headers = {"Accept": "application/json"}
    if "key" not in query and token:
        headers["Authorization"] = f"Bearer {status_key(token)}"
    kept = urllib.parse.urlencode({"key": query["key"][0]}) if "key" in query else ""
    return urllib.request.Request(
        urllib.parse.urlunsplit((url.scheme, url.netloc, "/status.json", kept, "")), headers=headers
    )


def fetch_status(request: urllib.request.Request, timeout: float) -> dict[str, Any]:
    """The status the page serves. Raises OSError (urllib.error.URLError / HTTPError) when it
    cannot be reached or refuses, ValueError when its answer is not a status."""
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        status = json.loads(reply.read())
    if not isinstance(status, dict) or "summary" not in status:
        raise ValueError("the answer is not a paramserve status (no summary)")
    return status


def format_status(status: Mapping[str, Any], events: int = 10) -> str:
    """The status as lines of text: the headline, training, closures, every worker (problems
    first), every parameter server and the newest ``events``."""
    now = float(status["time"])
    s = status["summary"]
    w, c = s["workers"], s["closures"]
    rate = _last(status["series"].get("steps_per_s", []))
    samples = _last(status["series"].get("samples_per_s", []))
    lines = [
        f"paramserve: {status['state']}, up {_duration(now - float(status['started']))}, at {_clock(now)}",
        f"training: {s['steps']} steps run ({_num(rate)}/s), step reported {_num(s['step'])}, loss {_num(s['loss'])}, "
        f"samples {_num(s['samples'])} ({_num(samples)}/s)"
        + "".join(f", {name} {_num(value)}" for name, value in s["metrics"].items()),
        f"closures: {c['scheduled']} scheduled, {c['queued']} queued, {c['running']} running, {c['done']} done, "
        f"{c['failed']} failed, {c['cancelled']} cancelled, {c['retried']} retried",
        f"workers: {w['total']} ({w['alive']} alive, {w['joining']} joining, {w['lost']} lost, {w['stopped']} stopped)",
    ]
    rows = s.get("rows")  # a page of an older version has none
    if rows and rows["pulled"] + rows["cached"]:
        ages = ", ".join(f"{age}: {count}" for age, count in rows["ages"].items()) or "-"
        lines.append(
            f"rows: {rows['pulled']} pulled, {rows['cached']} cached (hit rate {_num(rows['hit_rate'])}; "
            f"cached rows by age in steps: {ages})"
        )
    lines += _columns(
        ("worker", "state", "running", "done", "failed", "retried", "last seen"),
        [
            (x["address"], x["state"], x["running"], x["done"], x["failed"], x["retried"], _ago(x["last_seen"], now))
            for x in status["workers"]
        ],
    )
    lines.append(f"parameter servers: {len(status['servers'])}")
    lines += _columns(
        ("server", "state", "shards", "bytes", "version", "pushes/s", "recoveries", "last recovery"),
        [
            (
                p["address"],
                p["state"],
                _num(p["shards"]),
                bytes_text(p["bytes"]) if p["bytes"] is not None else "-",
                _num(p["version"]),
                _num(p["pushes_per_s"]),
                p["recoveries"],
                f"{p['last_recovery']} {_ago(p['last_recovery_time'], now)}" if p["last_recovery"] else "-",
            )
            for p in status["servers"]
        ],
    )
    shown = status["events"][-events:] if events > 0 else []
    lines.append(f"events: {status['events_total']} (newest {len(shown)})")
    lines += [f"  {_clock(e['time'])}  {e['kind']:<18} {e['subject']}: {e['message']}" for e in reversed(shown)]
    return "\n".join(lines)


def _columns(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    table = [list(headers), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]


def _last(values: Sequence[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4g}"
    return str(int(value)) if isinstance(value, (int, float)) else str(value)


def _ago(then: float | None, now: float) -> str:
    return "-" if then is None else f"{max(0.0, now - then):.1f}s ago"


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.events < 0:
        parser.error("--events must be at least 0")
    token = read_token_file(args.token_file) if args.token_file else check_token(os.environ.get(TOKEN_ENV), TOKEN_ENV)
    try:
        request = status_request(args.address, token)
    except ValueError as err:
        parser.error(str(err))
    try:
        status = fetch_status(request, args.timeout)
    except urllib.error.HTTPError as err:
        print(f"{parser.prog}: the page at {args.address} refused: HTTP {err.code} {err.reason}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as err:
        print(f"{parser.prog}: cannot read the status page at {args.address}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=1) if args.json else format_status(status, args.events))
    return 0


if __name__ == "__main__":
    parsed_parser = build_parser()
    sys.exit(main(parsed_parser.parse_args(), parsed_parser))
