"""The cluster description: where the parameter servers, the workers and the chief listen.

A ``ClusterSpec`` is resolved field by field, first match wins:

1. explicit flags (``ps``, ``workers``, ``chief``),
2. ``PARAMSERVE_PS`` / ``PARAMSERVE_WORKERS`` (comma-separated ``host:port``),
3. ``TF_CONFIG`` (the JSON TensorFlow uses: ``{"cluster": {...}, "task": {...}}``).

Every ``ClusterSpec`` that exists is valid: addresses parse, none repeats, there
is at least one parameter server and one worker. Secrets (the auth token) are
not part of it. Nothing here reads ``os.environ`` unless the caller leaves
``environ`` unset.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["ClusterSpec", "ClusterSpecError", "TaskSpec", "TfConfig", "parse_address", "parse_tf_config"]

logger = logging.getLogger(__name__)

ROLES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")
PS_ENV = "PARAMSERVE_PS"
WORKERS_ENV = "PARAMSERVE_WORKERS"
TF_CONFIG_ENV = "TF_CONFIG"

_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")
_DIGITS = re.compile(r"[0-9]+")
_BRACKETED = re.compile(r"\[([^\]]*)\](?::(.*))?")
_EXAMPLE_TF_CONFIG = '{"cluster": {"ps": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]}}'


class ClusterSpecError(ValueError):
    """A cluster description that cannot be used; the message names the problem and the fix."""


# --------------------------------------------------------------------------- addresses


def parse_address(text: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[ipv6]:port"`` into ``(host, port)``.

    IPv6 hosts come back without brackets (``"[::1]:80"`` -> ``("::1", 80)``).
    No name is resolved. Raises ``ClusterSpecError`` on a missing host, a
    missing, non-integer, zero or > 65535 port, or text that is no address.
    """
    if not isinstance(text, str):
        raise ClusterSpecError(
            f"address {text!r} is a {type(text).__name__}, not a string: "
            'write it as "host:port", e.g. "10.0.0.5:2222"'
        )
    stripped = text.strip()
    if not stripped:
        raise ClusterSpecError('empty address: write it as "host:port", e.g. "10.0.0.5:2222"')
    if any(c.isspace() for c in stripped):
        raise ClusterSpecError(f"address {text!r} contains whitespace: remove it (\"host:port\")")
    if stripped.startswith("["):
        host, port_text = _split_bracketed(stripped)
    else:
        host, port_text = _split_plain(stripped)
    return host, _parse_port(port_text, stripped)


def _split_bracketed(text: str) -> tuple[str, str | None]:
    match = _BRACKETED.fullmatch(text)
    if match is None:
        raise ClusterSpecError(
            f"address {text!r} is a malformed bracketed IPv6 address: write it as \"[::1]:2222\""
        )
    host, port_text = match.group(1), match.group(2)
    if not host:
        raise ClusterSpecError(f"address {text!r} has no host inside the brackets: write e.g. \"[::1]:2222\"")
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ClusterSpecError(
            f"address {text!r}: {host!r} is not an IPv6 address; brackets are only for IPv6 "
            'literals: write "[::1]:2222" or "hostname:2222"'
        ) from None
    return host, port_text


def _split_plain(text: str) -> tuple[str, str | None]:
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ClusterSpecError(f"address {text!r} has no port: write \"{text}:<port>\", e.g. \"{text}:2222\"")
    if not host:
        raise ClusterSpecError(f"address {text!r} has no host: write \"<host>{text}\", e.g. \"10.0.0.5{text}\"")
    if ":" in host and "/" not in host:
        raise ClusterSpecError(
            f"address {text!r} looks like an IPv6 address without brackets: put the IP in brackets "
            'and the port after them, e.g. "[::1]:2222"'
        )
    if not _HOSTNAME.fullmatch(host):
        raise ClusterSpecError(
            f"address {text!r}: {host!r} is not a hostname or IP address: write plain "
            '"host:port" with no scheme or path, e.g. "10.0.0.5:2222"'
        )
    return host, port_text


def _parse_port(port_text: str | None, address: str) -> int:
    if not port_text:
        raise ClusterSpecError(f"address {address!r} has no port after the host: write e.g. \"host:2222\"")
    if not _DIGITS.fullmatch(port_text):
        raise ClusterSpecError(
            f"address {address!r}: port {port_text!r} is not an integer: use a number in 1..65535"
        )
    port = int(port_text)
    if port == 0:
        raise ClusterSpecError(
            f"address {address!r}: port 0 means 'any free port' and cannot be dialed: "
            "give the port the server actually listens on (its --port-file reports it)"
        )
    if port > 65535:
        raise ClusterSpecError(f"address {address!r}: port {port} is out of range: use a number in 1..65535")
    return port


def _address_key(address: str) -> tuple[str, int]:
    """The identity of an address for duplicate detection (IP literals canonical, names lowercased)."""
    host, port = parse_address(address)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return host.lower(), port


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class TaskSpec:
    """This process's place in a TF_CONFIG cluster: ``type`` is a role, ``index`` its position."""

    type: str
    index: int

    def __post_init__(self) -> None:
        _check_task(self.type, self.index, where="TaskSpec")

    @classmethod
    def from_tf_config(cls, text: str) -> TaskSpec | None:
        """The ``task`` of a TF_CONFIG JSON text, or None when it has none.

        Raises ``ClusterSpecError`` if the text is invalid or the task is not in its cluster.
        """
        return parse_tf_config(text).task

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TaskSpec | None:
        """The task of ``environ["TF_CONFIG"]`` (default ``os.environ``), None when unset or taskless."""
        text = (os.environ if environ is None else environ).get(TF_CONFIG_ENV, "")
        return cls.from_tf_config(text) if text.strip() else None


@dataclass(frozen=True)
class ClusterSpec:
    """The addresses (``"host:port"``) of a parameter-server cluster; valid by construction.

    Raises ``ClusterSpecError`` when there is no parameter server, no worker, an
    address that does not parse, or the same address twice anywhere.
    """

    parameter_servers: tuple[str, ...]
    workers: tuple[str, ...]
    chief: str | None = None

    def __post_init__(self) -> None:
        ps = _as_address_tuple(self.parameter_servers, "parameter_servers")
        workers = _as_address_tuple(self.workers, "workers")
        chief = self.chief.strip() if isinstance(self.chief, str) else self.chief
        _check_cluster(ps, workers, chief)
        object.__setattr__(self, "parameter_servers", ps)
        object.__setattr__(self, "chief", chief)
        object.__setattr__(self, "workers", workers)

    def num_ps(self) -> int:
        """How many parameter servers the cluster has."""
        return len(self.parameter_servers)

    def num_workers(self) -> int:
        """How many workers the cluster has."""
        return len(self.workers)

    def as_tf_config_cluster(self) -> dict[str, list[str]]:
        """The ``cluster`` part of a TF_CONFIG: ``{"ps": [...], "worker": [...], "chief": [...]}``."""
        cluster = {"ps": list(self.parameter_servers), "worker": list(self.workers)}
        if self.chief is not None:
            cluster["chief"] = [self.chief]
        return cluster

    @classmethod
    def from_tf_config(cls, text: str) -> ClusterSpec:
        """The cluster of a TF_CONFIG JSON text (evaluators are ignored). Raises ``ClusterSpecError``."""
        jobs = parse_tf_config(text).jobs
        return _build(
            _Resolved(jobs.get("ps", ()), "TF_CONFIG cluster.ps"),
            _Resolved(jobs.get("worker", ()), "TF_CONFIG cluster.worker"),
            _Resolved(_only_chief(jobs), "TF_CONFIG cluster.chief"),
        )

    @classmethod
    def from_env(
        cls,
        argv_flags: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ClusterSpec:
        """Resolve each field from flags, then PARAMSERVE_PS / PARAMSERVE_WORKERS, then TF_CONFIG.

        ``argv_flags`` may hold ``ps`` and ``workers`` (a list of addresses or one
        comma-separated string; None means not given) and ``chief``; other keys
        are ignored, so ``vars(argparse_namespace)`` works. ``environ`` defaults
        to ``os.environ``; an empty variable counts as unset. A TF_CONFIG that is
        set must be valid even when flags override parts of it. Raises
        ``ClusterSpecError``.
        """
        flags = argv_flags or {}
        env = os.environ if environ is None else environ
        tf_text = env.get(TF_CONFIG_ENV, "")
        jobs = parse_tf_config(tf_text).jobs if tf_text.strip() else None
        ps = _resolve_addresses(flags.get("ps"), "flag ps", env.get(PS_ENV), PS_ENV, jobs, "ps")
        workers = _resolve_addresses(
            flags.get("workers"), "flag workers", env.get(WORKERS_ENV), WORKERS_ENV, jobs, "worker"
        )
        chief = _resolve_chief(flags.get("chief"), jobs)
        if ps is None and workers is None and jobs is None:
            raise ClusterSpecError(
                "no cluster description: pass the ps and workers flags, set "
                f"{PS_ENV} and {WORKERS_ENV} (comma-separated host:port), or set "
                f"{TF_CONFIG_ENV}, e.g. {_EXAMPLE_TF_CONFIG}"
            )
        spec = _build(
            ps or _Resolved((), f"flag ps, {PS_ENV} or TF_CONFIG cluster.ps"),
            workers or _Resolved((), f"flag workers, {WORKERS_ENV} or TF_CONFIG cluster.worker"),
            chief,
        )
        logger.info(
            "cluster: %d parameter servers from %s, %d workers from %s, chief %s",
            spec.num_ps(), ps.source if ps else "nowhere", spec.num_workers(),
            workers.source if workers else "nowhere", spec.chief or "none",
        )
        return spec


# --------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class _Resolved:
    """Addresses and the place they came from (named in error messages)."""

    addresses: tuple[str, ...]
    source: str


def _build(ps: _Resolved, workers: _Resolved, chief: _Resolved | None) -> ClusterSpec:
    # Addresses are checked here first so that an error names where the bad one came from.
    for resolved in (ps, workers, chief):
        if resolved is not None:
            _check_addresses(resolved)
    if not ps.addresses:
        raise ClusterSpecError(
            f"the cluster has no parameter servers (looked in {ps.source}): ParameterServerStrategy "
            "keeps variables on them; give at least one host:port"
        )
    if not workers.addresses:
        raise ClusterSpecError(
            f"the cluster has no workers (looked in {workers.source}): ParameterServerStrategy runs "
            "every step on a worker; give at least one host:port"
        )
    chief_address = chief.addresses[0] if chief is not None and chief.addresses else None
    return ClusterSpec(ps.addresses, workers.addresses, chief_address)


def _check_addresses(resolved: _Resolved) -> None:
    for i, address in enumerate(resolved.addresses):
        try:
            parse_address(address)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{resolved.source}[{i}]: {e} (fix it in {resolved.source})") from None


def _resolve_addresses(
    flag: Any, flag_name: str, env_value: str | None, env_name: str,
    jobs: Mapping[str, tuple[str, ...]] | None, job: str,
) -> _Resolved | None:
    if flag is not None:
        return _Resolved(_split_flag(flag, flag_name), flag_name)
    if env_value is not None and env_value.strip():
        return _Resolved(_split_commas(env_value, env_name), env_name)
    if jobs is not None and job in jobs:
        return _Resolved(jobs[job], f"TF_CONFIG cluster.{job}")
    return None


def _resolve_chief(flag: Any, jobs: Mapping[str, tuple[str, ...]] | None) -> _Resolved | None:
    if flag is not None:
        if not isinstance(flag, str):
            raise ClusterSpecError(f"flag chief is a {type(flag).__name__}: pass one \"host:port\" string")
        return _Resolved((flag.strip(),), "flag chief")
    if jobs is not None and "chief" in jobs:
        return _Resolved(_only_chief(jobs), "TF_CONFIG cluster.chief")
    return None


def _split_flag(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return _split_commas(value, name)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ClusterSpecError(
            f"{name} must be a list of \"host:port\" strings or one comma-separated string, "
            f"got {value!r}"
        )
    return tuple(address for item in value for address in _split_commas(item, name))


def _split_commas(text: str, name: str) -> tuple[str, ...]:
    parts = tuple(part.strip() for part in text.split(","))
    if any(not part for part in parts):
        raise ClusterSpecError(
            f"{name}={text!r} has an empty entry (a doubled, leading or trailing comma): "
            'write "host1:port,host2:port"'
        )
    return parts


def _only_chief(jobs: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    return jobs.get("chief", ())[:1]  # _parse_tf_config already refused more than one


# --------------------------------------------------------------------------- validation


def _as_address_tuple(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ClusterSpecError(
            f"ClusterSpec.{name} must be a tuple of \"host:port\" strings, got {value!r}: "
            f"wrap a single address as ({value!r},)"
        )
    if not all(isinstance(v, str) for v in value):
        raise ClusterSpecError(f"ClusterSpec.{name} must hold only \"host:port\" strings, got {value!r}")
    return tuple(v.strip() for v in value)


def _check_cluster(ps: tuple[str, ...], workers: tuple[str, ...], chief: str | None) -> None:
    if not ps:
        raise ClusterSpecError(
            "the cluster has no parameter servers: ParameterServerStrategy keeps variables on them; "
            "give at least one host:port"
        )
    if not workers:
        raise ClusterSpecError(
            "the cluster has no workers: ParameterServerStrategy runs every step on a worker; "
            "give at least one host:port"
        )
    if chief is not None and not isinstance(chief, str):
        raise ClusterSpecError(f"ClusterSpec.chief must be a \"host:port\" string or None, got {chief!r}")
    tasks = [(f"ps[{i}]", a) for i, a in enumerate(ps)] + [(f"worker[{i}]", a) for i, a in enumerate(workers)]
    if chief is not None:
        tasks.append(("chief", chief))
    _check_unique(tasks)


def _check_unique(tasks: list[tuple[str, str]]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for name, address in tasks:
        try:
            key = _address_key(address)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{name}: {e}") from None
        if key in seen:
            raise ClusterSpecError(
                f"address {address!r} appears twice ({seen[key]} and {name}): every task needs its "
                "own host:port; change one of them"
            )
        seen[key] = name


def _check_task(task_type: Any, index: Any, where: str) -> None:
    if not isinstance(task_type, str) or task_type not in ROLES:
        raise ClusterSpecError(
            f"{where} type {task_type!r} is not a role: use one of {', '.join(ROLES)}"
        )
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ClusterSpecError(
            f"{where} index {index!r} is not a non-negative integer: write a number such as 0 (not \"0\")"
        )


# --------------------------------------------------------------------------- TF_CONFIG


@dataclass(frozen=True)
class TfConfig:
    """A parsed TF_CONFIG: its jobs (role -> addresses, evaluators left out) and this process's task."""

    jobs: Mapping[str, tuple[str, ...]]
    task: TaskSpec | None


def parse_tf_config(text: str) -> TfConfig:
    """Parses and checks TF_CONFIG's structure (the one reader of TF_CONFIG); addresses are
    checked where they are used. Raises ``ClusterSpecError``."""
    top = _load_json_object(text)
    cluster = top.get("cluster", {})
    if not isinstance(cluster, dict):
        raise ClusterSpecError(
            f"TF_CONFIG cluster must be a JSON object mapping roles to address lists, got "
            f"{type(cluster).__name__}: e.g. {_EXAMPLE_TF_CONFIG}"
        )
    jobs = {role: _job_addresses(role, value) for role, value in cluster.items()}
    if len(jobs.get("chief", ())) > 1:
        raise ClusterSpecError(
            f"TF_CONFIG cluster.chief has {len(jobs['chief'])} entries: a cluster has at most one "
            "chief; move the others to cluster.worker"
        )
    task = _parse_task(top.get("task"), jobs)
    if "evaluator" in jobs:
        logger.info(
            "TF_CONFIG: ignoring the evaluator job %s: paramserve has no side-car evaluator "
            "(evaluate from the coordinator instead)", list(jobs["evaluator"]),
        )
    return TfConfig({role: addrs for role, addrs in jobs.items() if role != "evaluator"}, task)


def _load_json_object(text: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise ClusterSpecError(f"TF_CONFIG must be a JSON string, got {type(text).__name__}")
    try:
        top = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterSpecError(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
            f"set it to a JSON object such as {_EXAMPLE_TF_CONFIG}"
        ) from None
    if not isinstance(top, dict):
        raise ClusterSpecError(
            f"TF_CONFIG must be a JSON object, got a {type(top).__name__}: e.g. {_EXAMPLE_TF_CONFIG}"
        )
    return top


def _job_addresses(role: str, value: Any) -> tuple[str, ...]:
    if role not in ROLES:
        hint = " (TensorFlow's old 'master' role is called 'chief')" if role == "master" else ""
        raise ClusterSpecError(
            f"TF_CONFIG cluster has unknown role {role!r}: allowed roles are "
            f"{', '.join(ROLES)}; rename or remove it{hint}"
        )
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ClusterSpecError(
            f"TF_CONFIG cluster.{role} must be a list of \"host:port\" strings, got {value!r}: "
            f'e.g. "{role}": ["10.0.0.2:2222"]'
        )
    return tuple(v.strip() for v in value)


def _parse_task(task: Any, jobs: Mapping[str, tuple[str, ...]]) -> TaskSpec | None:
    if task is None or task == {}:
        return None
    if not isinstance(task, dict):
        raise ClusterSpecError(
            f"TF_CONFIG task must be a JSON object, got {task!r}: e.g. {{\"type\": \"worker\", \"index\": 0}}"
        )
    if "type" not in task:
        raise ClusterSpecError(
            f"TF_CONFIG task {task!r} has no 'type': add one, e.g. {{\"type\": \"worker\", \"index\": 0}}"
        )
    task_type, index = task["type"], task.get("index", 0)  # TensorFlow defaults the index to 0
    _check_task(task_type, index, where="TF_CONFIG task")
    size = len(jobs.get(task_type, ()))
    if size == 0:
        raise ClusterSpecError(
            f"TF_CONFIG task type {task_type!r} is not a job of its cluster (jobs: "
            f"{', '.join(sorted(jobs)) or 'none'}): add cluster.{task_type} or fix task.type"
        )
    if index >= size:
        raise ClusterSpecError(
            f"TF_CONFIG task index {index} is out of range for job {task_type!r}, which has {size} "
            f"task(s) (0..{size - 1}): fix task.index or add the address to cluster.{task_type}"
        )
    return TaskSpec(task_type, index)
