"""The cluster MultiWorkerMirroredStrategy trains on: which processes form its group and where
they meet (``ClusterResolver``), and how they communicate (``CommunicationOptions``,
``CollectiveCommunication``, ``select_backend``).

Where the cluster comes from (``ClusterResolver.from_env``), first match wins:
``TF_CONFIG`` (chief and workers; rank = the chief, then the workers by index;
the first task's address is where the group meets), torchrun's ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` / ``LOCAL_RANK``, else one
process alone.

They are apart from ``multi_worker`` (the strategy that joins the group and trains over it)
because they only describe the group and choose its backend: nothing here opens a
connection or holds a process group.
"""

from __future__ import annotations

import datetime
import enum
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paramserve.coordinator.cluster import ClusterSpecError, parse_address, parse_tf_config

__all__ = [
    "ClusterResolver",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CommunicationOptionsError",
    "select_backend",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 1800.0
"""torch.distributed's own default: how long a collective (and joining the group) may wait."""

_TRAINING_ROLES = ("chief", "worker")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------- communication options


class CollectiveCommunication(enum.Enum):
    """Which collective implementation carries the all-reduces (tf.distribute's names).

    RING is torch's gloo (over TCP; the replicas compute on the CPU), NCCL is NVIDIA's
    library (one GPU per process; the replicas compute on their GPUs), AUTO picks NCCL when
    every process has a GPU of its own and gloo otherwise (see ``select_backend``).
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


CommunicationImplementation = CollectiveCommunication
"""TensorFlow 2.4+ name of the same enum."""


class CommunicationOptionsError(ValueError):
    """A communication choice this machine cannot honour (e.g. NCCL without a GPU)."""


def select_backend(
    implementation: CollectiveCommunication,
    cuda_available: bool,
    nccl_available: bool,
    gpus: Sequence[str | None] | None = None,
) -> str:
    """The torch.distributed backend for ``implementation`` on a group with these capabilities.

    ``gpus``: by rank, the GPU each process of the group would drive (an identity such as the
    device's UUID; None: that process has no GPU of its own), once the processes have told each
    other; None before that. NCCL drives one GPU per process and cannot put two processes on
    one GPU (it fails at the first collective, "Duplicate GPU detected"). So processes sharing
    a GPU (two ranks on a one-GPU machine) or without one get gloo under AUTO, which trains
    correctly on any machine, rather than a failure; NCCL asked for explicitly is refused
    before training, with the reason, since the caller asked for something that cannot run.
    Every process decides from the same list, so all of them pick the same backend.

    Raises ``CommunicationOptionsError`` for NCCL without CUDA devices, without NCCL, or for
    processes that share a GPU or have none.
    """
    if implementation is CollectiveCommunication.RING:
        return "gloo"
    shared = _why_not_one_gpu_each(gpus) if gpus is not None else None
    if implementation is CollectiveCommunication.NCCL:
        if not cuda_available:
            raise CommunicationOptionsError(
                "CommunicationOptions(implementation=NCCL) needs CUDA GPUs, and this process sees none: "
                "use CollectiveCommunication.RING (gloo) or AUTO on CPU-only machines"
            )
        if not nccl_available:
            raise CommunicationOptionsError(
                "CommunicationOptions(implementation=NCCL): this torch build has no NCCL: "
                "install a CUDA build of torch, or use RING (gloo)"
            )
        if shared is not None:
            raise CommunicationOptionsError(
                f"CommunicationOptions(implementation=NCCL) needs a GPU of its own for every process, and {shared}: "
                "use CollectiveCommunication.AUTO or RING (gloo), or start at most as many processes per machine "
                "as it has GPUs (torchrun --nproc-per-node), each with its LOCAL_RANK"
            )
        return "nccl"
    return "nccl" if cuda_available and nccl_available and shared is None else "gloo"


def _why_not_one_gpu_each(gpus: Sequence[str | None]) -> str | None:
    """Why these processes (by rank) cannot each drive a GPU of its own; None when they can."""
    without = [rank for rank, gpu in enumerate(gpus) if gpu is None]
    if without:
        return f"rank(s) {without} have no GPU of their own (more processes than GPUs on their machine)"
    first: dict[str, int] = {}
    for rank, gpu in enumerate(map(str, gpus)):
        if gpu in first:
            return f"ranks {first[gpu]} and {rank} share GPU {gpu}"
        first[gpu] = rank
    return None


@dataclass(frozen=True)
class CommunicationOptions:
    """How the processes communicate.

    Args:
        implementation: a ``CollectiveCommunication`` (or its name); default AUTO.
        timeout_seconds: how long joining the group and each collective may wait
            before failing; None means torch's default (30 minutes).

    Raises ``CommunicationOptionsError`` on an unknown implementation or a timeout <= 0.
    """

    implementation: CollectiveCommunication = CollectiveCommunication.AUTO
    timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        implementation: Any = self.implementation
        if isinstance(implementation, str):
            try:
                implementation = CollectiveCommunication(implementation.upper())
            except ValueError:
                implementation = None  # reported below
        if not isinstance(implementation, CollectiveCommunication):
            raise CommunicationOptionsError(
                f"implementation {self.implementation!r} is not one of "
                f"{', '.join(c.name for c in CollectiveCommunication)}"
            )
        object.__setattr__(self, "implementation", implementation)
        timeout = self.timeout_seconds
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise CommunicationOptionsError(f"timeout_seconds must be a positive number or None, got {timeout!r}")

    def backend(self, gpus: Sequence[str | None] | None = None) -> str:
        """The torch.distributed backend ("gloo" or "nccl") on this machine, for a group whose
        processes drive ``gpus`` (None: not known yet); see ``select_backend``."""
        return select_backend(self.implementation, torch.cuda.is_available(), dist.is_nccl_available(), gpus)

    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class ClusterResolver:
    """This process's place in the group: its rank, the group's size and where it meets.

    ``master_addr``/``master_port`` is the address rank 0 listens on to form the
    group (None: a group of one, formed in memory, or a group that already exists). ``task_type``/``task_id`` are
    the TF_CONFIG task when the cluster came from TF_CONFIG. ``source`` says where
    the description came from (for logs).
    """

    rank: int
    world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    local_rank: int = 0
    task_type: str = "worker"
    task_id: int = 0
    source: str = "explicit"

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ClusterSpecError(
                f"rank {self.rank} is not in 0..{self.world_size - 1} (world size {self.world_size}) "
                f"in the cluster from {self.source}"
            )

    @property
    def is_chief(self) -> bool:
        """Rank 0 (the TF_CONFIG chief, or worker 0 when there is none) writes checkpoints and summaries."""
        return self.rank == 0

    def init_method(self) -> str | None:
        """``tcp://host:port`` of the master (IPv6 hosts in brackets), None for a group of one."""
        if self.master_addr is None:
            return None
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    @classmethod
    def from_tf_config(cls, text: str) -> ClusterResolver:
        """The cluster of a TF_CONFIG JSON text with ``chief``/``worker`` jobs and this process's task.

        Ranks follow the chief, then the workers by index; the group meets at the
        first task's address (rank 0 listens there; the other tasks' ports are not used).

        Raises ``ClusterSpecError`` on invalid JSON or structure, a bad address, a
        missing task, a task not in the cluster, or a ``ps`` job (parameter servers
        belong to ParameterServerStrategy).
        """
        config = parse_tf_config(text)  # checks the JSON, the roles and that the task is in its cluster
        task, jobs = config.task, config.jobs
        if jobs.get("ps"):
            raise ClusterSpecError(
                "TF_CONFIG has a ps job, but MultiWorkerMirroredStrategy has no parameter servers: "
                "remove cluster.ps, or train with ParameterServerStrategy"
            )
        if task is None:
            raise ClusterSpecError(
                'TF_CONFIG has no task: set "task" to this process\'s place, e.g. {"type": "worker", "index": 0}'
            )
        if task.type not in _TRAINING_ROLES:
            raise ClusterSpecError(
                f"TF_CONFIG task type {task.type!r} does not train under MultiWorkerMirroredStrategy: "
                f"use {' or '.join(_TRAINING_ROLES)}"
            )
        tasks = [(role, i, address) for role in _TRAINING_ROLES for i, address in enumerate(jobs.get(role, []))]
        _check_distinct(tasks)
        rank = next(r for r, (role, i, _) in enumerate(tasks) if (role, i) == (task.type, task.index))
        host, port = parse_address(tasks[0][2])
        return cls(rank, len(tasks), host, port, 0, task.type, task.index, "TF_CONFIG")

    @classmethod
    def from_torchrun_env(cls, environ: Mapping[str, str]) -> ClusterResolver:
        """The group torchrun describes in RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK).

        Raises ``ClusterSpecError`` when some are missing or malformed.
        """
        missing = [name for name in _TORCHRUN_VARS if not environ.get(name, "").strip()]
        if missing:
            raise ClusterSpecError(
                f"torchrun environment incomplete: {', '.join(missing)} unset; set all of "
                f"{', '.join(_TORCHRUN_VARS)} (torchrun does), or use TF_CONFIG"
            )
        rank = _env_int(environ, "RANK")
        world_size = _env_int(environ, "WORLD_SIZE")
        local_rank = _env_int(environ, "LOCAL_RANK") if environ.get("LOCAL_RANK", "").strip() else 0
        host = environ["MASTER_ADDR"].strip().strip("[]")
        bracketed = f"[{host}]" if ":" in host else host
        host, port = parse_address(f"{bracketed}:{environ['MASTER_PORT'].strip()}")
        return cls(rank, world_size, host, port, local_rank, "worker", rank, "torchrun environment")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterResolver:
        """TF_CONFIG if set, else torchrun's variables if RANK or WORLD_SIZE is set, else one process alone.

        ``environ`` defaults to ``os.environ``. Raises ``ClusterSpecError``.
        """
        env = os.environ if environ is None else environ
        if env.get("TF_CONFIG", "").strip():
            if env.get("RANK", "").strip():
                log.info("both TF_CONFIG and RANK are set: using TF_CONFIG")
            return cls.from_tf_config(env["TF_CONFIG"])
        if env.get("RANK", "").strip() or env.get("WORLD_SIZE", "").strip():
            return cls.from_torchrun_env(env)
        return cls(0, 1, source="no TF_CONFIG nor torchrun environment: a single process")


def _env_int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name].strip()
    if not text.isdigit():
        raise ClusterSpecError(f"{name}={text!r} is not a non-negative integer")
    return int(text)


def _check_distinct(tasks: Sequence[tuple[str, int, str]]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for role, index, address in tasks:
        try:
            host, port = parse_address(address)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"TF_CONFIG cluster.{role}[{index}]: {e}") from None
        key = (host.lower(), port)
        if key in seen:
            raise ClusterSpecError(
                f"address {address!r} appears twice ({seen[key]} and {role}[{index}]): give every task its own"
            )
        seen[key] = f"{role}[{index}]"
