"""A status page alone in a process of its own, for tests/service/test_status_page_attacks.py (run
as a script): the coordinator's process as far as the page is concerned.

    python status_page_process.py --soft-limit 256 --request-seconds 2 --token TOKEN

Lowers its own soft descriptor limit (RLIMIT_NOFILE) first, serves a page of three workers on
127.0.0.1 with the key of TOKEN, prints ``{"port": ..., "pid": ...}``, then answers one JSON line
per command read from stdin:

- ``descriptors``: ``{"open", "soft"}``, this process's open descriptors and soft limit;
- ``open N``: ``{"opened"}``, how many of N files it could open at once (then closes them): the
  coordinator's own work (a checkpoint, a channel) while the page is attacked;
- ``hold N`` / ``release``: opens N files and keeps them (``{"held"}``), or closes them;
- ``cpu``: ``{"cpu"}``, this process's CPU seconds so far;
- ``dropped``: ``{"dropped"}``, the page's dropped connections by reason;
- ``quit``: stops the page (``{"stopped"}``) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

FD_DIRECTORY = "/proc/self/fd"


def open_descriptors() -> int:
    try:
        return len(os.listdir(FD_DIRECTORY)) - 1  # less the listing's own
    except OSError:  # out of descriptors even to list them
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_files(count: int) -> list[int]:
    opened: list[int] = []
    for _ in range(count):
        try:
            opened.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    return opened


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--soft-limit", type=int, required=True)
    parser.add_argument("--request-seconds", type=float, required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.soft_limit, hard))

    from paramserve.coordinator.status.cluster_status import RunLog, status_key
    from paramserve.coordinator.status.page_server import PageLimits
    from paramserve.coordinator.status.status_page import StatusPage, StatusSources

    run = RunLog()
    for i in range(3):
        run.worker_state(f"127.0.0.1:{7000 + i}", "up")
    sources = StatusSources(
        run=run,
        queued=lambda: 5,
        running=lambda: {"127.0.0.1:7000": 1},
        in_flight=lambda: 1,
        checkpoint=lambda: None,
        parameter_servers=("ps:1",),
    )
    limits = PageLimits(request_seconds=args.request_seconds, reply_seconds=args.request_seconds)
    page = StatusPage(sources, key=status_key(args.token), limits=limits)
    port = page.start("127.0.0.1", 0)
    reply({"port": port, "pid": os.getpid()})
    held: list[int] = []
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "descriptors":
            reply({"open": open_descriptors(), "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]})
        elif command == "open":
            opened = open_files(int(argument))
            for descriptor in opened:
                os.close(descriptor)
            reply({"opened": len(opened)})
        elif command == "hold":
            held += open_files(int(argument))
            reply({"held": len(held)})
        elif command == "release":
            for descriptor in held:
                os.close(descriptor)
            held.clear()
            reply({"held": 0})
        elif command == "cpu":
            reply({"cpu": time.process_time()})
        elif command == "dropped":
            reply({"dropped": page.dropped()})
        elif command == "quit":
            break
    reply({"stopped": page.stop(10)})


def reply(answer: dict) -> None:
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
