"""tf.distribute.cluster_resolver: where every task of a cluster listens, and which task this is.

A ``ClusterResolver`` answers ``cluster_spec()`` (every job's addresses, as ``ClusterJobs``:
TensorFlow's ``tf.train.ClusterSpec``), ``task_type``/``task_id`` (this process's task),
``rpc_layer``, ``master()`` and ``num_accelerators()``. The strategies take one and turn it
into what they run on: ``ParameterServerStrategy`` into its ``ClusterSpec``
(``ClusterSpec.from_cluster_resolver``), ``MultiWorkerMirroredStrategy`` into its
``Rendezvous`` (``Rendezvous.from_cluster_resolver``).

- ``TFConfigClusterResolver``: TF_CONFIG, read again at every call (``psserver.tf_config``,
  the one reader of it);
- ``SimpleClusterResolver``: a cluster given as it is;
- ``KubernetesClusterResolver``: running pods found by label selector through the Kubernetes
  API (a client the caller may inject), or a headless Service's DNS answer
  (``coordinator.discovery.resolve_dns``, or an injected resolver).

Nothing here reads ``os.environ`` unless the caller leaves ``environ`` unset, and nothing
talks to Kubernetes or DNS before ``cluster_spec()`` is called.
"""

from __future__ import annotations

import abc
import enum
import importlib
import importlib.util
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from paramserve.psserver.runtime.tf_config import (
    TF_CONFIG_ENV,
    ClusterSpecError,
    TfConfig,
    parse_address,
    parse_tf_config,
)

__all__ = [
    "ClusterJobs",
    "ClusterResolver",
    "ExecutableLocation",
    "KubernetesClusterResolver",
    "PodLister",
    "ResolutionError",
    "Resolver",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "format_master_url",
    "resolve_dns",
]

Resolver = Callable[[str], frozenset[str]]
"""``"name:port"`` -> the ``"address:port"`` of every worker behind it now. Raises
ResolutionError when the answer is unknown (the resolver failed); returns an empty set
when the name has no address."""


def resolve_dns(service: str) -> frozenset[str]:
    """Every address the system resolver gives for ``service``'s name, with its port (a Resolver)."""
    host, port = parse_address(service)
    try:
        answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NO_ADDRESS:
            return frozenset()
        raise ResolutionError(f"could not resolve {host!r}: {err}") from err
    return frozenset(_join(str(sockaddr[0]), port) for _family, _type, _proto, _name, sockaddr in answers)


class ResolutionError(Exception):
    """The name could not be resolved this time (as opposed to: it has no address)."""


# DNS answers that mean "no such name" (nothing runs), rather than "could not ask".
_NO_ADDRESS = frozenset(
    code for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None)) if code is not None
)


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# --------------------------------------------------------------------------- the cluster's jobs


class ClusterJobs:
    """Every job of a cluster and its tasks' addresses, by task index (TF's ``tf.train.ClusterSpec``).

    Built from ``{"worker": ["host:port", ...], "ps": [...]}`` (or another ClusterJobs, or
    None: no job). Raises ``ClusterSpecError`` for a job name that is not a non-empty string,
    tasks that are not a list of ``"host:port"`` strings, or an address that does not parse.
    """

    def __init__(self, cluster: Mapping[str, Sequence[str]] | ClusterJobs | None = None):
        source = cluster.as_dict() if isinstance(cluster, ClusterJobs) else cluster or {}
        if not isinstance(source, Mapping):
            raise ClusterSpecError(
                f'a cluster is a mapping of job names to address lists, e.g. {{"worker": ["10.0.0.2:2222"]}}, '
                f"got {type(source).__name__}"
            )
        self._jobs = {str(job): _job_tasks(job, tasks) for job, tasks in source.items()}

    def as_dict(self) -> dict[str, list[str]]:
        """``{job: [address of task 0, task 1, ...]}``."""
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has. Raises ValueError for a job the cluster lacks."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name`` (0..n-1). Raises ValueError for a job the cluster lacks."""
        return list(range(self.num_tasks(job_name)))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name``. Raises ValueError when there is none."""
        tasks = self._tasks(job_name)
        if isinstance(task_index, bool) or not isinstance(task_index, int) or not 0 <= task_index < len(tasks):
            raise ValueError(
                f"no task with index {task_index!r} in job {job_name!r}, which has {len(tasks)} task(s): "
                f"use an index in 0..{len(tasks) - 1}"
            )
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str]:
        """The addresses of ``job_name``'s tasks, by index. Raises ValueError for a job the cluster lacks."""
        return list(self._tasks(job_name))

    def _tasks(self, job_name: str) -> tuple[str, ...]:
        if job_name not in self._jobs:
            raise ValueError(f"no job {job_name!r} in the cluster (jobs: {', '.join(self.jobs) or 'none'})")
        return self._jobs[job_name]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterJobs) and self._jobs == other._jobs

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._jobs.items())))

    def __repr__(self) -> str:
        return f"ClusterJobs({self.as_dict()!r})"


def _job_tasks(job: object, tasks: object) -> tuple[str, ...]:
    if not isinstance(job, str) or not job:
        raise ClusterSpecError(f"job name {job!r} is not a non-empty string: name jobs e.g. 'worker' or 'ps'")
    if isinstance(tasks, str) or not isinstance(tasks, Sequence) or not all(isinstance(t, str) for t in tasks):
        raise ClusterSpecError(f'job {job!r} must list its tasks as "host:port" strings, got {tasks!r}')
    for index, address in enumerate(tasks):
        try:
            parse_address(address)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"job {job!r} task {index}: {e}") from None
    return tuple(t.strip() for t in tasks)


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``"<rpc_layer>://<master>"``, or ``master`` alone without an RPC layer."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


# --------------------------------------------------------------------------- the resolver's contract


class ClusterResolver(abc.ABC):
    """Where the tasks of a cluster are, and which task this process is (TF's
    ``tf.distribute.cluster_resolver.ClusterResolver``): subclass it for a cluster manager of
    your own, implementing ``cluster_spec()`` and ``master()``.

    ``task_type``, ``task_id`` and ``rpc_layer`` may be set after construction (a resolver
    that cannot know them, such as Kubernetes', needs them set for MultiWorkerMirroredStrategy).
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterJobs:
        """Every job's addresses, as the cluster is now."""

    @abc.abstractmethod
    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task (default: this one) with its RPC layer, e.g. ``"grpc://10.0.0.2:2222"``."""

    @property
    def task_type(self) -> str | None:
        """This process's job ("chief", "worker", "ps", "evaluator"), None when unknown."""
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This process's index in its job, None when unknown."""
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol the tasks speak, e.g. "grpc" (paramserve's processes always speak gRPC)."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        """The environment the cluster runs in (TF's "google", "cloud"); "" when unknown."""
        return ""

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """Accelerators by kind on a task's machine: by default this machine's CUDA GPUs,
        ``{"GPU": n}``, or ``{}`` without any."""
        count = torch.cuda.device_count()
        return {"GPU": count} if count else {}

    def worker_service(self) -> str | None:
        """A ``"name:port"`` whose every address is a worker, found again while training runs
        (``coordinator.discovery``), or None: the workers are those ``cluster_spec()`` lists.
        paramserve's addition: ParameterServerStrategy lets workers join and leave through it."""
        return None


# --------------------------------------------------------------------------- TF_CONFIG


class TFConfigClusterResolver(ClusterResolver):
    """The cluster of the TF_CONFIG environment variable, read again at every call, as TensorFlow does.

    Args:
        task_type, task_id, rpc_layer, environment: override TF_CONFIG's ``task.type``,
            ``task.index``, ``rpc_layer`` and ``environment``.
        environ: where TF_CONFIG is read; default ``os.environ``.

    Its methods raise ``ClusterSpecError`` when TF_CONFIG is set but invalid (not JSON, an
    unknown role, a task outside its cluster, a bad address).
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ):
        super().__init__(task_type, task_id, rpc_layer)
        self._environment = environment
        self._environ = environ

    def _config(self) -> TfConfig | None:
        text = (os.environ if self._environ is None else self._environ).get(TF_CONFIG_ENV, "")
        return parse_tf_config(text) if text.strip() else None

    def cluster_spec(self) -> ClusterJobs:
        """TF_CONFIG's cluster, evaluators included; no job when TF_CONFIG is unset."""
        config = self._config()
        if config is None:
            return ClusterJobs()
        evaluators = {"evaluator": config.evaluators} if config.evaluators else {}
        return ClusterJobs({**config.jobs, **evaluators})

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return self._task_type
        config = self._config()
        return config.task.type if config is not None and config.task is not None else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        if self._task_id is not None:
            return self._task_id
        config = self._config()
        return config.task.index if config is not None and config.task is not None else None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        if self._rpc_layer is not None:
            return self._rpc_layer
        config = self._config()
        return config.rpc_layer if config is not None else None

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        if self._environment is not None:
            return self._environment
        config = self._config()
        return (config.environment if config is not None else None) or ""

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task (default: TF_CONFIG's) with its RPC layer; "" for a cluster of
        at most one task. Raises RuntimeError when no task is given and TF_CONFIG names none."""
        cluster = self.cluster_spec()
        if sum(cluster.num_tasks(job) for job in cluster.jobs) <= 1:
            return ""
        return _task_url(self, cluster, task_type, task_id, rpc_layer)


def _task_url(
    resolver: ClusterResolver, cluster: ClusterJobs, task_type: str | None, task_id: int | None, rpc_layer: str | None
) -> str:
    task_type = task_type if task_type is not None else resolver.task_type
    task_id = task_id if task_id is not None else resolver.task_id
    if task_type is None or task_id is None:
        raise RuntimeError(
            "no task to find the master of: pass master(task_type=..., task_id=...), or set the "
            'resolver\'s task_type and task_id (TF_CONFIG: "task": {"type": "worker", "index": 0})'
        )
    return format_master_url(cluster.task_address(task_type, task_id), rpc_layer or resolver.rpc_layer)


# --------------------------------------------------------------------------- a cluster given as it is


class SimpleClusterResolver(ClusterResolver):
    """A cluster given as it is (TF's ``SimpleClusterResolver``).

    Args:
        cluster_spec: a ClusterJobs, or a mapping of job names to address lists.
        master: what ``master()`` returns when asked for no particular task.
        task_type, task_id: this process's task (None: unknown).
        environment: what ``environment`` returns.
        num_accelerators: accelerators by kind, e.g. ``{"GPU": 2}`` (None: none).
        rpc_layer: the protocol, e.g. "grpc".

    Raises ``ClusterSpecError`` for a malformed cluster and ValueError for accelerator counts
    that are not non-negative integers by kind.
    """

    def __init__(
        self,
        cluster_spec: ClusterJobs | Mapping[str, Sequence[str]],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ):
        super().__init__(task_type, task_id, rpc_layer)
        self._cluster = ClusterJobs(cluster_spec)
        self._master = master
        self._environment = environment
        self._accelerators = _accelerator_counts(num_accelerators)

    def cluster_spec(self) -> ClusterJobs:
        return self._cluster

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The given task's address when both ``task_type`` and ``task_id`` are given, else the
        ``master`` given at construction, with the RPC layer."""
        if task_type is not None and task_id is not None:
            return format_master_url(self._cluster.task_address(task_type, task_id), rpc_layer or self.rpc_layer)
        return format_master_url(self._master, rpc_layer or self.rpc_layer)

    @property
    def environment(self) -> str:
        return self._environment

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """The counts given at construction (``{}`` when none were)."""
        return dict(self._accelerators)


def _accelerator_counts(counts: Mapping[str, int] | None) -> dict[str, int]:
    if counts is None:
        return {}
    if not isinstance(counts, Mapping) or not all(
        isinstance(kind, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for kind, n in counts.items()
    ):
        raise ValueError(f'num_accelerators must map kinds to counts >= 0, e.g. {{"GPU": 2}}, got {counts!r}')
    return dict(counts)


# --------------------------------------------------------------------------- Kubernetes


class ExecutableLocation(enum.Enum):
    """Where the program runs, so where the Kubernetes client finds its credentials
    (TF's ``KubernetesExecutableLocation``): in a pod of the cluster, or outside it (kubeconfig)."""

    WITHIN_CLUSTER = 0
    OFF_CLUSTER = 1


class PodLister(Protocol):
    """The one call of the Kubernetes API the resolver makes (``kubernetes.client.CoreV1Api``
    fits): the pods matching a label selector, as ``.items`` with ``.metadata.name``,
    ``.status.phase`` and ``.status.pod_ip``."""

    def list_pod_for_all_namespaces(self, *, label_selector: str) -> Any: ...


class KubernetesClusterResolver(ClusterResolver):
    """The cluster of a Kubernetes deployment (TF's ``KubernetesClusterResolver``), looked up
    again at every ``cluster_spec()``.

    Args:
        job_to_label_mapping: job -> label selectors of its pods, e.g.
            ``{"worker": ["job-name=worker"], "ps": ["job-name=ps"]}``; each job's tasks are
            its running pods, sorted by name, at their pod IP and ``tf_server_port``. Default
            (with no service mapping either) ``{"worker": ["job-name=tensorflow"]}``, as TF.
        tf_server_port: the port every pod serves on.
        rpc_layer: the protocol, "grpc".
        override_client: the Kubernetes API to ask (a ``PodLister``); default a
            ``kubernetes.client.CoreV1Api`` with credentials by ``executable_location``.
        executable_location: where the credentials come from when no client is given.
        job_to_service_mapping: paramserve's addition: job -> ``"name:port"`` of a headless
            Service whose DNS answer is every ready pod of that job (no API access needed).
            A "worker" service also becomes ParameterServerStrategy's worker service: workers
            then join and leave while training runs.
        resolver: how a service name is resolved; default the system's DNS.

    It cannot know this process's task: set ``task_type`` and ``task_id`` where a strategy
    needs them. Raises ImportError when pods are to be listed without an ``override_client``
    and the ``kubernetes`` package is not installed, ValueError for a job in both mappings
    or an unknown ``executable_location``, ``ClusterSpecError`` for a bad port or service.
    """

    def __init__(
        self,
        job_to_label_mapping: Mapping[str, Sequence[str]] | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str | None = "grpc",
        override_client: PodLister | None = None,
        executable_location: ExecutableLocation = ExecutableLocation.WITHIN_CLUSTER,
        *,
        job_to_service_mapping: Mapping[str, str] | None = None,
        resolver: Resolver = resolve_dns,
    ):
        super().__init__(None, None, rpc_layer)
        if job_to_label_mapping is None and job_to_service_mapping is None:
            job_to_label_mapping = {"worker": ["job-name=tensorflow"]}
        self._labels = {job: tuple(selectors) for job, selectors in (job_to_label_mapping or {}).items()}
        self._services = dict(job_to_service_mapping or {})
        _check_kubernetes_arguments(self._labels, self._services, tf_server_port, executable_location)
        if self._labels and override_client is None and importlib.util.find_spec("kubernetes") is None:
            raise ImportError(
                "KubernetesClusterResolver lists pods with the Kubernetes Python client: `pip install kubernetes`, "
                "pass override_client=, or find the pods by DNS with job_to_service_mapping= (a headless Service)"
            )
        self._port = tf_server_port
        self._client = override_client
        self._location = executable_location
        self._resolver = resolver

    def cluster_spec(self) -> ClusterJobs:
        """Every job's tasks now: running pods by label (RuntimeError for a matching pod that is
        not Running, as TF), then each service's addresses, sorted. A service that cannot be
        resolved raises ``coordinator.discovery.ResolutionError``."""
        cluster = {job: _pod_addresses(self._pods(), selectors, self._port) for job, selectors in self._labels.items()}
        cluster.update({job: sorted(self._resolver(service)) for job, service in self._services.items()})
        return ClusterJobs(cluster)

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of a task (default: ``task_type``/``task_id`` as set), or "" when none is known."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self.rpc_layer)

    def worker_service(self) -> str | None:
        return self._services.get("worker")

    def _pods(self) -> PodLister:
        if self._client is None:
            self._client = _kubernetes_client(self._location)
        return self._client


def _check_kubernetes_arguments(
    labels: Mapping[str, Sequence[str]], services: Mapping[str, str], port: int, location: ExecutableLocation
) -> None:
    both = sorted(set(labels) & set(services))
    if both:
        raise ValueError(f"jobs {both} are in both job_to_label_mapping and job_to_service_mapping: keep one")
    if not isinstance(location, ExecutableLocation):
        raise ValueError(f"executable_location must be an ExecutableLocation, got {location!r}")
    parse_address(f"pod:{port}")
    for job, service in services.items():
        try:
            parse_address(service)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"job_to_service_mapping[{job!r}]: {e}") from None


def _pod_addresses(client: PodLister, selectors: Iterable[str], port: int) -> list[str]:
    addresses = []
    for selector in selectors:
        pods = client.list_pod_for_all_namespaces(label_selector=selector).items
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            if pod.status.phase != "Running":
                raise RuntimeError(
                    f'pod "{pod.metadata.name}" (selector {selector!r}) is not running; phase: "{pod.status.phase}": '
                    "wait until every pod runs, or narrow the selector"
                )
            # The pod's own IP: a pod serves there (TF reads the node's, right only on the host network).
            ip = str(pod.status.pod_ip)
            addresses.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return addresses


def _kubernetes_client(location: ExecutableLocation) -> PodLister:
    """The Kubernetes API with the credentials of ``location`` (an optional dependency: imported
    only here, when pods are listed without an injected client)."""
    config = importlib.import_module("kubernetes.config")
    client = importlib.import_module("kubernetes.client")
    if location is ExecutableLocation.OFF_CLUSTER:
        config.load_kube_config()
    else:
        config.load_incluster_config()
    lister: PodLister = client.CoreV1Api()
    return lister
