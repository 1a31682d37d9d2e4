"""TF_CONFIG and ``host:port`` addresses: the one reader of both, shared by every process.

``TF_CONFIG`` is the JSON TensorFlow uses to tell each process of a cluster who is
where (``{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": "ps", "index": 0}}``).
The coordinator builds its ``ClusterSpec`` from the ``cluster`` part
(``coordinator.cluster``); ``paramserve ps`` and ``paramserve worker`` take the address
they serve on from the ``task`` part (``task_address``). It lives here, below every
other package, so that the servers need nothing of the coordinator to read it.
Nothing here reads ``os.environ`` unless the caller leaves ``environ`` unset.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paramserve.psserver.protocol.errors import ConfigurationError

__all__ = [
    "ClusterSpecError",
    "ROLES",
    "TF_CONFIG_ENV",
    "TaskSpec",
    "TfConfig",
    "address_key",
    "parse_address",
    "parse_tf_config",
    "task_address",
]

ROLES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")
TF_CONFIG_ENV = "TF_CONFIG"

_HOSTNAME = re.compile(r"[A-Za-z0-9_.-]+")
_DIGITS = re.compile(r"[0-9]+")
_BRACKETED = re.compile(r"\[([^\]]*)\](?::(.*))?")
EXAMPLE_TF_CONFIG = '{"cluster": {"ps": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"]}}'


class ClusterSpecError(ConfigurationError):
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
            f'address {text!r} is a {type(text).__name__}, not a string: write it as "host:port", e.g. "10.0.0.5:2222"'
        )
    stripped = text.strip()
    if not stripped:
        raise ClusterSpecError('empty address: write it as "host:port", e.g. "10.0.0.5:2222"')
    if any(c.isspace() for c in stripped):
        raise ClusterSpecError(f'address {text!r} contains whitespace: remove it ("host:port")')
    if stripped.startswith("["):
        host, port_text = _split_bracketed(stripped)
    else:
        host, port_text = _split_plain(stripped)
    return host, _parse_port(port_text, stripped)


def _split_bracketed(text: str) -> tuple[str, str | None]:
    match = _BRACKETED.fullmatch(text)
    if match is None:
        raise ClusterSpecError(f'address {text!r} is a malformed bracketed IPv6 address: write it as "[::1]:2222"')
    host, port_text = match.group(1), match.group(2)
    if not host:
        raise ClusterSpecError(f'address {text!r} has no host inside the brackets: write e.g. "[::1]:2222"')
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
        raise ClusterSpecError(f'address {text!r} has no port: write "{text}:<port>", e.g. "{text}:2222"')
    if not host:
        raise ClusterSpecError(f'address {text!r} has no host: write "<host>{text}", e.g. "10.0.0.5{text}"')
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
        raise ClusterSpecError(f'address {address!r} has no port after the host: write e.g. "host:2222"')
    if not _DIGITS.fullmatch(port_text):
        raise ClusterSpecError(f"address {address!r}: port {port_text!r} is not an integer: use a number in 1..65535")
    port = int(port_text)
    if port == 0:
        raise ClusterSpecError(
            f"address {address!r}: port 0 means 'any free port' and cannot be dialed: "
            "give the port the server actually listens on (its --port-file reports it)"
        )
    if port > 65535:
        raise ClusterSpecError(f"address {address!r}: port {port} is out of range: use a number in 1..65535")
    return port


def address_key(address: str) -> tuple[str, int]:
    """The identity of an address for duplicate detection (IP literals canonical, names lowercased)."""
    host, port = parse_address(address)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return host.lower(), port


# --------------------------------------------------------------------------- TF_CONFIG


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


def _check_task(task_type: Any, index: Any, where: str) -> None:
    if not isinstance(task_type, str) or task_type not in ROLES:
        raise ClusterSpecError(f"{where} type {task_type!r} is not a role: use one of {', '.join(ROLES)}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ClusterSpecError(
            f'{where} index {index!r} is not a non-negative integer: write a number such as 0 (not "0")'
        )


@dataclass(frozen=True)
class TfConfig:
    """A parsed TF_CONFIG: its jobs (role -> addresses, evaluators left out: they are no part of
    the training cluster), the evaluators' addresses, this process's task, and the optional
    ``rpc_layer`` (e.g. "grpc") and ``environment`` (e.g. "cloud") TensorFlow reads beside them."""

    jobs: Mapping[str, tuple[str, ...]]
    task: TaskSpec | None
    evaluators: tuple[str, ...] = field(default=())
    rpc_layer: str | None = None
    environment: str | None = None

    def task_address(self) -> str | None:
        """The address of this process's task (None without a task)."""
        if self.task is None:
            return None
        if self.task.type == "evaluator":
            return self.evaluators[self.task.index]
        return self.jobs[self.task.type][self.task.index]


def parse_tf_config(text: str) -> TfConfig:
    """Parses and checks TF_CONFIG's structure (the one reader of TF_CONFIG); addresses are
    checked where they are used. Raises ``ClusterSpecError``."""
    top = _load_json_object(text)
    cluster = top.get("cluster", {})
    if not isinstance(cluster, dict):
        raise ClusterSpecError(
            f"TF_CONFIG cluster must be a JSON object mapping roles to address lists, got "
            f"{type(cluster).__name__}: e.g. {EXAMPLE_TF_CONFIG}"
        )
    jobs = {role: _job_addresses(role, value) for role, value in cluster.items()}
    if len(jobs.get("chief", ())) > 1:
        raise ClusterSpecError(
            f"TF_CONFIG cluster.chief has {len(jobs['chief'])} entries: a cluster has at most one "
            "chief; move the others to cluster.worker"
        )
    task = _parse_task(top.get("task"), jobs)
    training = {role: addrs for role, addrs in jobs.items() if role != "evaluator"}
    extras = {key: _optional_text(top, key) for key in ("rpc_layer", "environment")}
    return TfConfig(training, task, jobs.get("evaluator", ()), **extras)


def _optional_text(top: Mapping[str, Any], key: str) -> str | None:
    value = top.get(key)
    if value is not None and not isinstance(value, str):
        raise ClusterSpecError(f'TF_CONFIG {key} must be a string such as "grpc", got {value!r}: fix or remove it')
    return value


def task_address(role: str, environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Where a server of ``role`` ("ps" or "worker") listens by TF_CONFIG's task: ``(host, port)``,
    None when TF_CONFIG is unset or has no task.

    Raises ``ClusterSpecError`` when TF_CONFIG is invalid or its task is another role (the
    process would serve where another task is expected).
    """
    text = (os.environ if environ is None else environ).get(TF_CONFIG_ENV, "")
    if not text.strip():
        return None
    config = parse_tf_config(text)
    if config.task is None:
        return None
    if config.task.type != role:
        raise ClusterSpecError(
            f"TF_CONFIG task is {config.task.type} {config.task.index}, but this process serves as {role}: "
            f'set task.type to "{role}", or pass --host and --port to ignore TF_CONFIG'
        )
    address = config.task_address()
    assert address is not None
    return parse_address(address)


def _load_json_object(text: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise ClusterSpecError(f"TF_CONFIG must be a JSON string, got {type(text).__name__}")
    try:
        top = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterSpecError(
            f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
            f"set it to a JSON object such as {EXAMPLE_TF_CONFIG}"
        ) from None
    if not isinstance(top, dict):
        raise ClusterSpecError(f"TF_CONFIG must be a JSON object, got a {type(top).__name__}: e.g. {EXAMPLE_TF_CONFIG}")
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
            f'TF_CONFIG cluster.{role} must be a list of "host:port" strings, got {value!r}: '
            f'e.g. "{role}": ["10.0.0.2:2222"]'
        )
    return tuple(v.strip() for v in value)


def _parse_task(task: Any, jobs: Mapping[str, tuple[str, ...]]) -> TaskSpec | None:
    if task is None or task == {}:
        return None
    if not isinstance(task, dict):
        raise ClusterSpecError(
            f'TF_CONFIG task must be a JSON object, got {task!r}: e.g. {{"type": "worker", "index": 0}}'
        )
    if "type" not in task:
        raise ClusterSpecError(
            f'TF_CONFIG task {task!r} has no \'type\': add one, e.g. {{"type": "worker", "index": 0}}'
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
