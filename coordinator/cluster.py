"""The cluster description: where the parameter servers, the workers and the chief listen.

A ``ClusterSpec`` is resolved field by field, first match wins:

1. explicit flags (``ps``, ``workers``, ``chief``, ``worker_service``),
2. ``PARAMSERVE_PS`` / ``PARAMSERVE_WORKERS`` (comma-separated ``host:port``),
   ``PARAMSERVE_WORKER_SERVICE`` (one ``name:port``),
3. ``TF_CONFIG`` (the JSON TensorFlow uses: ``{"cluster": {...}, "task": {...}}``; read by
   ``psserver.tf_config``, which the servers share).

A strategy given a TensorFlow-style ``ClusterResolver`` (``coordinator.cluster_resolver``)
takes its jobs instead (``ClusterSpec.from_cluster_resolver``).

A worker service is a DNS name whose every address is a worker (a Compose service
scaled with ``--scale``, a Kubernetes headless Service): the coordinator resolves it
again and again and the workers it finds join and leave (``coordinator.discovery``).

Every ``ClusterSpec`` that exists is valid: addresses parse, none repeats, there
is at least one parameter server and one worker or a worker service. Secrets (the
auth token) are not part of it. Nothing here reads ``os.environ`` unless the caller leaves
``environ`` unset.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paramserve.coordinator.cluster_resolver import ClusterResolver
from paramserve.psserver.runtime.tf_config import (
    EXAMPLE_TF_CONFIG,
    ROLES,
    TF_CONFIG_ENV,
    ClusterSpecError,
    TaskSpec,
    TfConfig,
    address_key,
    parse_address,
    parse_tf_config,
)

__all__ = ["ClusterSpec", "ClusterSpecError", "TaskSpec", "TfConfig", "parse_address", "parse_tf_config"]

logger = logging.getLogger(__name__)

PS_ENV = "PARAMSERVE_PS"
WORKERS_ENV = "PARAMSERVE_WORKERS"
WORKER_SERVICE_ENV = "PARAMSERVE_WORKER_SERVICE"


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class ClusterSpec:
    """The addresses (``"host:port"``) of a parameter-server cluster; valid by construction.

    ``workers`` are the workers listed; ``worker_service`` (``"name:port"``), when set, is a
    DNS name whose addresses are workers too, found while training runs
    (``coordinator.discovery``). Raises ``ClusterSpecError`` when there is no parameter
    server, no worker and no worker service, an address that does not parse, or the same
    address twice anywhere.

    TensorFlow's ``tf.train.ClusterSpec({"ps": [...], "worker": [...], "chief": [...]})``
    spelling works too: a jobs mapping given alone as the first argument (an "evaluator" job
    is no part of the training cluster and is left out).
    """

    parameter_servers: tuple[str, ...]
    workers: tuple[str, ...] = ()
    chief: str | None = None
    worker_service: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.parameter_servers, Mapping):
            self._adopt_tf_jobs(self.parameter_servers)
        ps = _as_address_tuple(self.parameter_servers, "parameter_servers")
        workers = _as_address_tuple(self.workers, "workers")
        chief = self.chief.strip() if isinstance(self.chief, str) else self.chief
        service = _as_service(self.worker_service)
        _check_cluster(ps, workers, chief, service)
        object.__setattr__(self, "parameter_servers", ps)
        object.__setattr__(self, "chief", chief)
        object.__setattr__(self, "workers", workers)
        object.__setattr__(self, "worker_service", service)

    def _adopt_tf_jobs(self, jobs: Mapping[str, Any]) -> None:
        """Takes TF's jobs mapping in place of the fields (still checked by __post_init__)."""
        if self.workers or self.chief is not None or self.worker_service is not None:
            raise ClusterSpecError(
                "ClusterSpec got TensorFlow's jobs mapping and other fields too: pass the mapping alone, "
                'e.g. ClusterSpec({"ps": [...], "worker": [...]}), or the fields alone'
            )
        unknown = sorted(set(jobs) - {*ROLES, "evaluator"})
        if unknown:
            raise ClusterSpecError(f"ClusterSpec got jobs {unknown}: a parameter-server cluster has {', '.join(ROLES)}")
        chiefs = tuple(jobs.get("chief", ()))
        if len(chiefs) > 1:
            raise ClusterSpecError(f"ClusterSpec got {len(chiefs)} chiefs: a cluster has one")
        object.__setattr__(self, "parameter_servers", tuple(jobs.get("ps", ())))
        object.__setattr__(self, "workers", tuple(jobs.get("worker", ())))
        object.__setattr__(self, "chief", chiefs[0] if chiefs else None)

    def num_ps(self) -> int:
        """How many parameter servers the cluster has."""
        return len(self.parameter_servers)

    def num_workers(self) -> int:
        """How many workers the cluster lists (those of a worker service come and go:
        ``ClusterCoordinator.num_workers`` counts them)."""
        return len(self.workers)

    def as_tf_config_cluster(self) -> dict[str, list[str]]:
        """The ``cluster`` part of a TF_CONFIG: ``{"ps": [...], "worker": [...], "chief": [...]}``
        (TF_CONFIG has no worker service: only the listed workers)."""
        cluster = {"ps": list(self.parameter_servers), "worker": list(self.workers)}
        if self.chief is not None:
            cluster["chief"] = [self.chief]
        return cluster

    @classmethod
    def from_tf_config(cls, text: str) -> ClusterSpec:
        """The cluster of a TF_CONFIG JSON text (evaluators are no part of it). Raises ``ClusterSpecError``."""
        jobs = _training_jobs(parse_tf_config(text))
        return _build(
            _Resolved(jobs.get("ps", ()), "TF_CONFIG cluster.ps"),
            _Resolved(jobs.get("worker", ()), "TF_CONFIG cluster.worker"),
            _Resolved(_only_chief(jobs), "TF_CONFIG cluster.chief"),
        )

    @classmethod
    def from_cluster_resolver(cls, resolver: ClusterResolver) -> ClusterSpec:
        """The cluster a ``ClusterResolver`` describes (TF's jobs: "ps", "worker", "chief";
        evaluators are no part of it), with its worker service when it has one.

        Raises ``ClusterSpecError`` for another job, more than one chief, no parameter server,
        no worker, or an address that does not parse.
        """
        jobs = resolver.cluster_spec().as_dict()
        unknown = sorted(set(jobs) - set(ROLES))
        if unknown:
            raise ClusterSpecError(
                f"{type(resolver).__name__} has jobs {unknown}: ParameterServerStrategy knows {', '.join(ROLES)}; "
                "rename them (the coordinator is the 'chief')"
            )
        if len(jobs.get("chief", [])) > 1:
            raise ClusterSpecError(f"{type(resolver).__name__} has {len(jobs['chief'])} chiefs: a cluster has one")
        where = f"{type(resolver).__name__}.cluster_spec()"
        service = resolver.worker_service()
        return _build(
            _Resolved(tuple(jobs.get("ps", ())), f"{where} job ps"),
            _Resolved(() if service else tuple(jobs.get("worker", ())), f"{where} job worker"),
            _Resolved(tuple(jobs.get("chief", ())), f"{where} job chief"),
            _Resolved((service,), f"{type(resolver).__name__}.worker_service()") if service else None,
        )

    @classmethod
    def resolve(
        cls, cluster: ClusterSpec | ClusterResolver | None, environ: Mapping[str, str] | None = None
    ) -> ClusterSpec:
        """The cluster a strategy was given: a ClusterSpec as it is, a ClusterResolver's
        (``from_cluster_resolver``), or None: ``from_env(environ=environ)``. Raises TypeError
        for anything else, ``ClusterSpecError`` for a cluster that cannot be used."""
        if cluster is None:
            return cls.from_env(environ=environ)
        if isinstance(cluster, ClusterSpec):
            return cluster
        if isinstance(cluster, ClusterResolver):
            return cls.from_cluster_resolver(cluster)
        raise TypeError(
            f"the cluster is a {type(cluster).__name__}: pass a ClusterResolver (e.g. TFConfigClusterResolver()), "
            "a ClusterSpec, or None to read it from the environment"
        )

    @classmethod
    def from_env(
        cls,
        argv_flags: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ClusterSpec:
        """Resolve each field from flags, then PARAMSERVE_PS / PARAMSERVE_WORKERS, then TF_CONFIG.

        ``argv_flags`` may hold ``ps`` and ``workers`` (a list of addresses or one
        comma-separated string; None means not given), ``chief`` and ``worker_service``
        (``PARAMSERVE_WORKER_SERVICE`` otherwise); other keys are ignored, so
        ``vars(argparse_namespace)`` works. ``environ`` defaults to ``os.environ``; an empty
        variable counts as unset. A TF_CONFIG that is set must be valid even when flags override
        parts of it. Raises ``ClusterSpecError``.
        """
        flags = argv_flags or {}
        env = os.environ if environ is None else environ
        tf_text = env.get(TF_CONFIG_ENV, "")
        jobs = _training_jobs(parse_tf_config(tf_text)) if tf_text.strip() else None
        ps = _resolve_addresses(flags.get("ps"), "flag ps", env.get(PS_ENV), PS_ENV, jobs, "ps")
        workers = _resolve_addresses(
            flags.get("workers"), "flag workers", env.get(WORKERS_ENV), WORKERS_ENV, jobs, "worker"
        )
        chief = _resolve_chief(flags.get("chief"), jobs)
        service = _resolve_service(flags.get("worker_service"), env.get(WORKER_SERVICE_ENV))
        if ps is None and workers is None and jobs is None and service is None:
            raise ClusterSpecError(
                "no cluster description: pass the ps and workers flags, set "
                f"{PS_ENV} and {WORKERS_ENV} (comma-separated host:port) or {WORKER_SERVICE_ENV} "
                f"(a DNS name:port whose addresses are the workers), or set {TF_CONFIG_ENV}, e.g. {EXAMPLE_TF_CONFIG}"
            )
        spec = _build(
            ps or _Resolved((), f"flag ps, {PS_ENV} or TF_CONFIG cluster.ps"),
            workers or _Resolved((), f"flag workers, {WORKERS_ENV}, {WORKER_SERVICE_ENV} or TF_CONFIG cluster.worker"),
            chief,
            service,
        )
        logger.info(
            "cluster: %d parameter servers from %s, %d workers from %s, worker service %s, chief %s",
            spec.num_ps(),
            ps.source if ps else "nowhere",
            spec.num_workers(),
            workers.source if workers else "nowhere",
            spec.worker_service or "none",
            spec.chief or "none",
        )
        return spec


def _training_jobs(config: TfConfig) -> Mapping[str, tuple[str, ...]]:
    if config.evaluators:
        logger.info(
            "TF_CONFIG: the evaluator job %s is no part of the training cluster; run "
            "`paramserve evaluator --checkpoint-dir DIR` there",
            list(config.evaluators),
        )
    return config.jobs


# --------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class _Resolved:
    """Addresses and the place they came from (named in error messages)."""

    addresses: tuple[str, ...]
    source: str


def _build(ps: _Resolved, workers: _Resolved, chief: _Resolved | None, service: _Resolved | None = None) -> ClusterSpec:
    # Addresses are checked here first so that an error names where the bad one came from.
    for resolved in (ps, workers, chief, service):
        if resolved is not None:
            _check_addresses(resolved)
    if not ps.addresses:
        raise ClusterSpecError(
            f"the cluster has no parameter servers (looked in {ps.source}): ParameterServerStrategy "
            "keeps variables on them; give at least one host:port"
        )
    if not workers.addresses and service is None:
        raise ClusterSpecError(
            f"the cluster has no workers (looked in {workers.source}): ParameterServerStrategy runs "
            "every step on a worker; give at least one host:port, or a worker service name:port"
        )
    chief_address = chief.addresses[0] if chief is not None and chief.addresses else None
    return ClusterSpec(ps.addresses, workers.addresses, chief_address, service.addresses[0] if service else None)


def _check_addresses(resolved: _Resolved) -> None:
    for i, address in enumerate(resolved.addresses):
        try:
            parse_address(address)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{resolved.source}[{i}]: {e} (fix it in {resolved.source})") from None


def _resolve_addresses(
    flag: Any,
    flag_name: str,
    env_value: str | None,
    env_name: str,
    jobs: Mapping[str, tuple[str, ...]] | None,
    job: str,
) -> _Resolved | None:
    if flag is not None:
        return _Resolved(_split_flag(flag, flag_name), flag_name)
    if env_value is not None and env_value.strip():
        return _Resolved(_split_commas(env_value, env_name), env_name)
    if jobs is not None and job in jobs:
        return _Resolved(jobs[job], f"TF_CONFIG cluster.{job}")
    return None


def _resolve_service(flag: Any, env_value: str | None) -> _Resolved | None:
    if flag is not None:
        if not isinstance(flag, str):
            raise ClusterSpecError(f'flag worker_service is a {type(flag).__name__}: pass one "name:port" string')
        return _Resolved((flag.strip(),), "flag worker_service")
    if env_value is not None and env_value.strip():
        return _Resolved((env_value.strip(),), WORKER_SERVICE_ENV)
    return None


def _resolve_chief(flag: Any, jobs: Mapping[str, tuple[str, ...]] | None) -> _Resolved | None:
    if flag is not None:
        if not isinstance(flag, str):
            raise ClusterSpecError(f'flag chief is a {type(flag).__name__}: pass one "host:port" string')
        return _Resolved((flag.strip(),), "flag chief")
    if jobs is not None and "chief" in jobs:
        return _Resolved(_only_chief(jobs), "TF_CONFIG cluster.chief")
    return None


def _split_flag(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return _split_commas(value, name)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ClusterSpecError(
            f'{name} must be a list of "host:port" strings or one comma-separated string, got {value!r}'
        )
    return tuple(address for item in value for address in _split_commas(item, name))


def _split_commas(text: str, name: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in text.split(","))
    if any(not part for part in parts):
        raise ClusterSpecError(
            f'{name}={text!r} has an empty entry (a doubled, leading or trailing comma): write "host1:port,host2:port"'
        )
    return parts


def _only_chief(jobs: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    return jobs.get("chief", ())[:1]  # _parse_tf_config already refused more than one


# --------------------------------------------------------------------------- validation


def _as_address_tuple(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ClusterSpecError(
            f'ClusterSpec.{name} must be a tuple of "host:port" strings, got {value!r}: '
            f"wrap a single address as ({value!r},)"
        )
    if not all(isinstance(v, str) for v in value):
        raise ClusterSpecError(f'ClusterSpec.{name} must hold only "host:port" strings, got {value!r}')
    return tuple(v.strip() for v in value)


def _as_service(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ClusterSpecError(f'ClusterSpec.worker_service must be one "name:port" string or None, got {value!r}')
    try:
        parse_address(value.strip())
    except ClusterSpecError as e:
        raise ClusterSpecError(f"ClusterSpec.worker_service: {e}") from None
    return value.strip()


def _check_cluster(ps: tuple[str, ...], workers: tuple[str, ...], chief: str | None, service: str | None) -> None:
    if not ps:
        raise ClusterSpecError(
            "the cluster has no parameter servers: ParameterServerStrategy keeps variables on them; "
            "give at least one host:port"
        )
    if not workers and service is None:
        raise ClusterSpecError(
            "the cluster has no workers: ParameterServerStrategy runs every step on a worker; "
            "give at least one host:port, or a worker service name:port"
        )
    if chief is not None and not isinstance(chief, str):
        raise ClusterSpecError(f'ClusterSpec.chief must be a "host:port" string or None, got {chief!r}')
    tasks = [(f"ps[{i}]", a) for i, a in enumerate(ps)] + [(f"worker[{i}]", a) for i, a in enumerate(workers)]
    if chief is not None:
        tasks.append(("chief", chief))
    _check_unique(tasks)


def _check_unique(tasks: list[tuple[str, str]]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for name, address in tasks:
        try:
            key = address_key(address)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{name}: {e}") from None
        if key in seen:
            raise ClusterSpecError(
                f"address {address!r} appears twice ({seen[key]} and {name}): every task needs its "
                "own host:port; change one of them"
            )
        seen[key] = name
