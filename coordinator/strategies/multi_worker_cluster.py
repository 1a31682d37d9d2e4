"""The cluster MultiWorkerMirroredStrategy trains on: which processes form its group and where
they meet (``Rendezvous``), and how they communicate (``CommunicationOptions``,
``CollectiveCommunication``, ``select_backend``).

A ``ClusterResolver`` (``coordinator.cluster_resolver``: TF_CONFIG, a given cluster,
Kubernetes) becomes a Rendezvous with ``Rendezvous.from_cluster_resolver``. Without one, the
group comes from the environment (``Rendezvous.from_env``), first match wins:
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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paramserve.coordinator.cluster import ClusterSpecError, parse_address, parse_tf_config
from paramserve.coordinator.cluster_resolver import ClusterJobs, ClusterResolver, SimpleClusterResolver

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CommunicationOptionsError",
    "Rendezvous",
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


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for the chosen ``backend``.

    NCCL carries CUDA tensors only, while a group also gathers CPU tensors (metric states,
    objects): alone it fails them with "No backend type associated with device type cpu". So an
    NCCL group maps CPU tensors to gloo, with torch's device-to-backend form.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def chosen_backend(group_backend: str) -> str:
    """The backend a strategy names for a group's own backend string (the inverse of
    ``process_group_backend``: a group that drives CUDA tensors with NCCL is an NCCL group)."""
    return "nccl" if "nccl" in group_backend else group_backend


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
        bytes_per_pack: the largest flat tensor one gradient all-reduce carries (TF's packs;
            0, the default: 64 MiB). Smaller packs bound the extra memory of packing; larger
            ones make fewer collectives.

    Raises ``CommunicationOptionsError`` on an unknown implementation, a timeout <= 0 or a
    negative ``bytes_per_pack``.
    """

    implementation: CollectiveCommunication = CollectiveCommunication.AUTO
    timeout_seconds: float | None = None
    bytes_per_pack: int = 0

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
        pack = self.bytes_per_pack
        if isinstance(pack, bool) or not isinstance(pack, int) or pack < 0:
            raise CommunicationOptionsError(f"bytes_per_pack must be an integer >= 0 (0: automatic), got {pack!r}")

    def backend(self, gpus: Sequence[str | None] | None = None) -> str:
        """The torch.distributed backend ("gloo" or "nccl") on this machine, for a group whose
        processes drive ``gpus`` (None: not known yet); see ``select_backend``."""
        return select_backend(self.implementation, torch.cuda.is_available(), dist.is_nccl_available(), gpus)

    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)


def strategy_arguments(
    first: Any, second: Any, communication: CollectiveCommunication | str | None = None
) -> tuple[Any, CommunicationOptions]:
    """MultiWorkerMirroredStrategy's cluster and communication options from its two positional
    arguments, in TensorFlow's order ``(cluster_resolver, communication_options)`` or
    paramserve's earlier ``(communication_options, cluster_resolver)`` (communication options
    are told apart from a cluster by their type), and from TF's experimental
    ``communication=`` (an implementation). Returns ``(cluster, options)``; the cluster is
    whatever was passed (None: from the environment).

    Raises TypeError when both arguments are communication options, ValueError when
    ``communication`` is given beside communication options.
    """
    options_given = [a for a in (first, second) if isinstance(a, CommunicationOptions)]
    if len(options_given) > 1:
        raise TypeError("two CommunicationOptions were passed: pass cluster_resolver=..., communication_options=...")
    cluster = second if isinstance(first, CommunicationOptions) else first
    options = options_given[0] if options_given else None
    if communication is not None:
        if options is not None:
            raise ValueError(
                "communication= and communication_options= both choose the implementation: pass "
                "communication_options=CommunicationOptions(implementation=...) alone"
            )
        options = CommunicationOptions(implementation=communication)  # type: ignore[arg-type]  # validated there
    return cluster, options or CommunicationOptions()


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class Rendezvous:
    """This process's place in the group: its rank, the group's size and where it meets.

    ``master_addr``/``master_port`` is the address rank 0 listens on to form the
    group (None: a group of one, formed in memory, or a group that already exists). ``task_type``/``task_id`` are
    the task when the cluster came from TF_CONFIG or a ClusterResolver, and ``cluster`` its jobs
    (None: not known). ``source`` says where the description came from (for logs).
    """

    rank: int
    world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    local_rank: int = 0
    task_type: str = "worker"
    task_id: int = 0
    source: str = "explicit"
    cluster: ClusterJobs | None = field(default=None, compare=False)

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

    def cluster_resolver(self) -> ClusterResolver:
        """This group as a ClusterResolver (what ``strategy.cluster_resolver`` returns when the
        strategy was given none): its jobs when known, its task, and its master address."""
        return SimpleClusterResolver(
            self.cluster or ClusterJobs(), self.init_method() or "", self.task_type, self.task_id
        )

    @classmethod
    def resolve(cls, resolver: ClusterResolver | Rendezvous | None, environ: Mapping[str, str] | None) -> Rendezvous:
        """The group of a ClusterResolver (``from_cluster_resolver``), a Rendezvous as it is, or,
        for None, the environment's (``from_env(environ)``). Raises TypeError for anything else."""
        if resolver is None:
            return cls.from_env(environ)
        if isinstance(resolver, Rendezvous):
            return resolver
        if isinstance(resolver, ClusterResolver):
            return cls.from_cluster_resolver(resolver)
        raise TypeError(
            f"cluster_resolver is a {type(resolver).__name__}: pass a ClusterResolver (e.g. "
            "TFConfigClusterResolver()), a Rendezvous, or None to read the group from the environment"
        )

    @classmethod
    def from_tf_config(cls, text: str) -> Rendezvous:
        """The cluster of a TF_CONFIG JSON text with ``chief``/``worker`` jobs and this process's task.

        Ranks follow the chief, then the workers by index; the group meets at the
        first task's address (rank 0 listens there; the other tasks' ports are not used).

        Raises ``ClusterSpecError`` on invalid JSON or structure, a bad address, a
        missing task, a task not in the cluster, or a ``ps`` job (parameter servers
        belong to ParameterServerStrategy).
        """
        config = parse_tf_config(text)  # checks the JSON, the roles and that the task is in its cluster
        task = config.task
        if task is None and not config.jobs.get("ps"):
            raise ClusterSpecError(
                'TF_CONFIG has no task: set "task" to this process\'s place, e.g. {"type": "worker", "index": 0}'
            )
        jobs = ClusterJobs({**config.jobs, **({"evaluator": config.evaluators} if config.evaluators else {})})
        return cls._from_jobs(jobs, task.type if task else None, task.index if task else None, "TF_CONFIG")

    @classmethod
    def from_cluster_resolver(cls, resolver: ClusterResolver) -> Rendezvous:
        """This process's place in the cluster of a ``ClusterResolver`` (TF's way to give
        MultiWorkerMirroredStrategy its cluster): ranks follow the chief, then the workers by
        index; the group meets at the first task's address. A resolver with no job at all
        describes one process alone, as TensorFlow reads it.

        Raises ``ClusterSpecError`` when the resolver has no task_type/task_id (set them: a
        KubernetesClusterResolver cannot know them), the task is not a chief or worker of the
        cluster, the cluster has a ``ps`` job, another job, or an address twice.
        """
        cluster = resolver.cluster_spec()
        source = type(resolver).__name__
        if not cluster:
            return cls(0, 1, source=f"{source} with an empty cluster: a single process", cluster=cluster)
        other = sorted(set(cluster.jobs) - {*_TRAINING_ROLES, "ps", "evaluator"})
        if other:
            raise ClusterSpecError(
                f"{source} has jobs {other}: MultiWorkerMirroredStrategy trains a 'chief' and 'worker' job; rename them"
            )
        if resolver.task_type is None or resolver.task_id is None:
            raise ClusterSpecError(
                f"{source} does not say which task this process is: set resolver.task_type (e.g. 'worker') and "
                "resolver.task_id (its index) before building the strategy"
            )
        return cls._from_jobs(cluster, resolver.task_type, resolver.task_id, source)

    @classmethod
    def _from_jobs(cls, cluster: ClusterJobs, task_type: str | None, task_id: int | None, source: str) -> Rendezvous:
        """The place of task ``task_type``/``task_id`` among the training tasks of ``cluster``."""
        jobs = cluster.as_dict()
        if jobs.get("ps"):
            raise ClusterSpecError(
                f"the cluster from {source} has a ps job, but MultiWorkerMirroredStrategy has no parameter servers: "
                "remove the ps job, or train with ParameterServerStrategy"
            )
        if task_type not in _TRAINING_ROLES:
            raise ClusterSpecError(
                f"task type {task_type!r} from {source} does not train under MultiWorkerMirroredStrategy: "
                f"use {' or '.join(_TRAINING_ROLES)}"
            )
        tasks = [(role, i, address) for role in _TRAINING_ROLES for i, address in enumerate(jobs.get(role, []))]
        _check_distinct(tasks)
        ranks = [r for r, (role, i, _) in enumerate(tasks) if (role, i) == (task_type, task_id)]
        if not ranks:
            raise ClusterSpecError(
                f"task {task_type} {task_id!r} from {source} is not in its cluster, whose {task_type} job has "
                f"{len(jobs.get(task_type, []))} task(s): fix the task index or add its address"
            )
        host, port = parse_address(tasks[0][2])
        role, index, _ = tasks[ranks[0]]
        return cls(ranks[0], len(tasks), host, port, 0, role, index, source, cluster)

    @classmethod
    def from_torchrun_env(cls, environ: Mapping[str, str]) -> Rendezvous:
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
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Rendezvous:
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
