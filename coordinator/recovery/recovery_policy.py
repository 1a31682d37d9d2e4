"""The recovery policy: pure decisions about parameter servers that fail and come back.

No clocks, threads or I/O here (times are passed in): ``coordinator.ps_recovery`` probes the
servers, reads checkpoints' manifests and restores shards, and asks these functions what each
observation means and what to do, logging the decision's reason.

- ``judge_probe``: is a server suspect after this probe? A server that answers with a new
  incarnation restarted; one that cannot be reached twice in a row is lost; one whose
  connection is up but that answers late is busy (creating a large table, applying a large
  step), and a busy server is not a dead one: it is never recovered for being slow.
- ``lost_variables``: which variables a server no longer holds (it restarted empty), and
  ``lost_tables``: which dynamic embedding tables (every server holds a shard of each).
- ``plan_restore``: where to restore them from: the newest whole checkpoint that holds them
  (for a dynamic table saved incrementally, whole means its bases are there too), at the
  policy's recovery point, or why that cannot be done.
"""

from __future__ import annotations

import enum
import pathlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from paramserve.psserver.protocol.types import ShardRef, VariableLayout

__all__ = [
    "CheckpointFacts",
    "Probe",
    "ProbeResult",
    "RecoveryPoint",
    "RecoveryPolicy",
    "RestorePlan",
    "ServerWatch",
    "Unrecoverable",
    "Verdict",
    "judge_probe",
    "lost_tables",
    "lost_variables",
    "plan_restore",
]


class RecoveryPoint(enum.Enum):
    LOST_SHARDS = "lost_shards"
    """Only what the failed server lost goes back to the checkpoint; the others keep training."""
    ALL = "all"
    """Every server goes back to the checkpoint: the model is the checkpoint's, consistent."""


@dataclass(frozen=True)
class RecoveryPolicy:
    """How the coordinator recovers failed parameter servers (times in seconds)."""

    enabled: bool = True
    """False: a failed parameter server fails the closures that used it, as in TF."""
    recovery_point: RecoveryPoint = RecoveryPoint.LOST_SHARDS
    probe_interval: float = 1.0
    """How often the monitor probes every server while the variables exist."""
    probe_timeout: float = 2.0
    """Deadline of one probe."""
    misses_to_suspect: int = 2
    """Probes in a row that cannot reach a server before it is suspected lost."""
    poll_interval: float = 0.25
    """How often a failed server is probed while waiting for its replacement."""
    replacement_timeout: float = 600.0
    """How long a failed server may take to come back before the closures fail."""

    def __post_init__(self) -> None:
        if min(self.probe_interval, self.probe_timeout, self.poll_interval, self.replacement_timeout) <= 0:
            raise ValueError("RecoveryPolicy intervals and timeouts must be positive")
        if self.misses_to_suspect < 1:
            raise ValueError(f"RecoveryPolicy.misses_to_suspect must be >= 1, got {self.misses_to_suspect}")
        if not isinstance(self.recovery_point, RecoveryPoint):
            object.__setattr__(self, "recovery_point", RecoveryPoint(self.recovery_point))


# ---------------------------------------------------------------- the failure detector


class ProbeResult(enum.Enum):
    ANSWERED = "answered"
    """The server answered, with its store's incarnation."""
    BUSY = "busy"
    """No answer within the deadline, but its connection is up: the process is alive and slow."""
    UNREACHABLE = "unreachable"
    """Connection refused, reset or down: nothing serves at the address now."""


@dataclass(frozen=True)
class Probe:
    result: ProbeResult
    incarnation: str = ""
    """With ANSWERED: the incarnation of the server's store (a new one on every start)."""
    missing: int = 0
    """With ANSWERED, at a server's first answer: how many variables and tables placed on it it
    does not hold (the monitor lists its shards once, to know the incarnation it adopts holds
    them; later answers are judged by incarnation alone)."""


@dataclass(frozen=True)
class ServerWatch:
    """What the detector remembers of one server between probes."""

    incarnation: str = ""
    """The incarnation last seen answering ("" before the first answer)."""
    misses: int = 0
    """Probes in a row that could not reach it."""
    busy_since: float | None = None
    """When it started answering late (None: it answers in time)."""


@dataclass(frozen=True)
class Verdict:
    suspect: bool
    reason: str


def judge_probe(watch: ServerWatch, probe: Probe, now: float, policy: RecoveryPolicy) -> tuple[ServerWatch, Verdict]:
    """What ``probe`` of a server watched as ``watch`` means, at time ``now``."""
    if probe.result is ProbeResult.ANSWERED:
        known = watch.incarnation or probe.incarnation
        after = ServerWatch(probe.incarnation)
        if not watch.incarnation and probe.missing:
            return after, Verdict(
                True,
                f"its first answer lacks {probe.missing} variables placed on it: it restarted "
                "before the monitor first saw it",
            )
        if known != probe.incarnation:
            return after, Verdict(True, f"it restarted (incarnation {known[:8]} -> {probe.incarnation[:8]})")
        return after, Verdict(False, "it answered")
    if probe.result is ProbeResult.BUSY:
        since = watch.busy_since if watch.busy_since is not None else now
        return replace(watch, misses=0, busy_since=since), Verdict(
            False, f"it is busy: connected but no answer for {now - since:.1f}s (a slow server is not a lost one)"
        )
    misses = watch.misses + 1
    after = replace(watch, misses=misses, busy_since=None)
    if misses >= policy.misses_to_suspect:
        return after, Verdict(True, f"it could not be reached {misses} times in a row")
    return after, Verdict(False, f"it could not be reached ({misses} of {policy.misses_to_suspect})")


# ---------------------------------------------------------------- what to restore, from where


def lost_variables(
    group: int, held: Collection[ShardRef], layouts: Mapping[str, VariableLayout]
) -> dict[str, VariableLayout]:
    """The variables with a shard placed on shard group ``group`` that its server does not hold
    (``held``). A shard's ``server`` is its group (an unreplicated cluster's groups are one server each)."""
    return {
        name: layout
        for name, layout in layouts.items()
        if any(shard.server == group and layout.ref(shard) not in held for shard in layout.shards)
    }


def lost_tables(held: Collection[str], created: Collection[str]) -> list[str]:
    """The dynamic tables of ``created`` (those on the servers) that a server does not hold
    (``held``: the tables it lists); each server holds one shard of every table."""
    return sorted(set(created) - set(held))


@dataclass(frozen=True)
class CheckpointFacts:
    """What recovery knows of one checkpoint candidate (read from its manifest)."""

    path: pathlib.Path
    whole: bool
    """Every variable's saved shards cover all its rows, every shard file is there, and so are
    the checkpoints it needs (the bases of its dynamic tables' deltas)."""
    variables: frozenset[str] = frozenset()
    """What it holds, by checkpoint key: variables and dynamic tables."""


@dataclass(frozen=True)
class RestorePlan:
    point: RecoveryPoint | None
    """None: nothing was lost, nothing to restore."""
    checkpoint: pathlib.Path | None
    """Where the lost checkpointed variables come from (None: none of them is checkpointed)."""
    reason: str


class Unrecoverable(Exception):
    """The server cannot be restored; the message says why and what to do."""


def plan_restore(
    lost: Collection[str],
    keys: Mapping[str, str | None],
    candidates: Sequence[CheckpointFacts],
    point: RecoveryPoint,
) -> RestorePlan:
    """How to restore ``lost`` (variables and dynamic tables by name; ``keys``: each one's name in
    checkpoints, None for one no checkpoint holds) from ``candidates`` (best first). Raises
    Unrecoverable."""
    if not lost:
        return RestorePlan(None, None, "it holds all its shards: nothing to restore")
    needed = sorted(keys[name] or "" for name in lost if keys[name] is not None)
    if not needed:
        return RestorePlan(
            RecoveryPoint.LOST_SHARDS,
            None,
            f"{len(lost)} lost variables hold no trained state: back to their initial values",
        )
    for facts in candidates:
        if facts.whole and all(key in facts.variables for key in needed):
            return RestorePlan(point, facts.path, f"{len(lost)} lost variables restored from {facts.path}")
    raise Unrecoverable(_no_checkpoint_reason(needed, candidates))


def _no_checkpoint_reason(needed: Sequence[str], candidates: Sequence[CheckpointFacts]) -> str:
    if not candidates:
        return (
            f"it restarted without {len(needed)} variables (e.g. {needed[0]!r}) and this program saved no "
            "checkpoint to restore them from: save checkpoints while training (CheckpointManager, or fit's "
            "BackupAndRestore / ModelCheckpoint) so that a restarted parameter server can be restored"
        )
    whole = [facts for facts in candidates if facts.whole]
    if not whole:
        return (
            f"none of the {len(candidates)} checkpoints it could restore from is whole (e.g. {candidates[0].path}: "
            "shards or files are missing); delete the damaged ones and restart the program, which restores "
            "the newest whole checkpoint"
        )
    missing = next(key for key in needed if key not in whole[0].variables)
    return (
        f"it lost variables the newest whole checkpoint {whole[0].path} does not hold (e.g. {missing!r}, "
        "built after it was saved): the next checkpoint will hold them; until then such a loss cannot be undone"
    )
