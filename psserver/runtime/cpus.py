"""How many torch threads a paramserve process uses: its share of the CPUs it may run on.

torch starts one intra-op thread per core in every process. Several processes on one
machine (a local cluster: servers, workers, the coordinator) then run many times slower
than with threads sized to their share (measured 24x on 16 cores with 5 processes). The
rule, for every server and worker:

    threads = max(1, usable CPUs // processes sharing them)

- *usable CPUs*: the CPUs this process may run on (its affinity mask, e.g. ``taskset`` or a
  Kubernetes cpuset), capped by a cgroup CPU quota (``cpu.max``; a container's CPU limit),
  rounded down, at least 1.
- *processes sharing them*: ``PARAMSERVE_PROCESSES_PER_HOST``, which ``LocalCluster`` and
  ``paramserve launch`` set for the processes they start; 1 when unset (one process per
  machine or container, as in a deployment).

``OMP_NUM_THREADS``, the variable torch itself reads, is honoured where it is set (a whole
number >= 1); ``--torch-threads N`` overrides both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["OMP_ENV", "PROCESSES_ENV", "torch_threads", "usable_cpus"]

PROCESSES_ENV = "PARAMSERVE_PROCESSES_PER_HOST"
OMP_ENV = "OMP_NUM_THREADS"
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(cpu_max: Path = _CGROUP_CPU_MAX) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 quota when one is set."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def _cgroup_quota(cpu_max: Path) -> float | None:
    """The CPU quota in CPUs from a cgroup v2 ``cpu.max`` ("max 100000" or "200000 100000")."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def torch_threads(requested: int | None, environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int:
    """``requested`` when given, else ``OMP_NUM_THREADS`` when set, else this process's share of
    the usable CPUs (the module's rule).

    Raises ValueError for a requested count below 1 or a malformed PARAMSERVE_PROCESSES_PER_HOST
    or OMP_NUM_THREADS.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"torch threads must be >= 1, got {requested}")
        return requested
    env = os.environ if environ is None else environ
    chosen = env.get(OMP_ENV, "").strip()
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"{OMP_ENV}={chosen!r} must be a whole number >= 1 (torch threads per process)")
        return int(chosen)
    text = env.get(PROCESSES_ENV, "").strip()
    sharing = 1
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{PROCESSES_ENV}={text!r} must be a whole number >= 1 (processes sharing this machine)")
        sharing = int(text)
    return max(1, (cpus if cpus is not None else usable_cpus()) // sharing)
