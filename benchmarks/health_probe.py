"""CPU of one container health check: ``paramserve-health`` against ``paramserve health``.

Starts a parameter server on 127.0.0.1 (port 0), then runs each probe command ``--runs`` times as a
new process, as Docker does, and reports the median user+system CPU seconds of one probe (from
``os.wait4``) and its wall time. Both commands must exit 0 (SERVING).

    python benchmarks/health_probe.py --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def one_probe(argv: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of running ``argv`` once; it must exit 0."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"{argv} exited {child.returncode}")
    return usage.ru_utime + usage.ru_stime, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    from paramserve.psserver.server import ServerConfig, build_server

    server = build_server(ServerConfig(host="127.0.0.1", port=0))
    address = f"127.0.0.1:{server.port}"
    bindir = os.path.dirname(sys.executable)
    commands = {
        "paramserve-health": [
            shutil.which("paramserve-health", path=bindir) or "paramserve-health",
            "--quiet",
            "--timeout",
            "2",
            address,
        ],
        "paramserve health": [shutil.which("paramserve", path=bindir) or "paramserve", "health", address],
    }
    report = {}
    try:
        for name, argv in commands.items():
            one_probe(argv)  # warm the page cache
            runs = [one_probe(argv) for _ in range(args.runs)]
            report[name] = {
                "cpu_ms_median": round(1000 * statistics.median(c for c, _ in runs), 1),
                "cpu_ms_max": round(1000 * max(c for c, _ in runs), 1),
                "wall_ms_median": round(1000 * statistics.median(w for _, w in runs), 1),
                "runs": args.runs,
            }
    finally:
        server.stop(grace=0)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
