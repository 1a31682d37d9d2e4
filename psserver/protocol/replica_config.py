"""A server's place in its replica group, as the coordinator decides it and the wire carries it.

The coordinator sends a :class:`ReplicaConfig` (``Configure``), ``convert`` translates it, and
the server's replication code acts on it; the type lives in the shared vocabulary so that
the wire translation does not load the server's replication machinery.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ReplicaConfig", "ReplicaRole"]


class ReplicaRole(enum.Enum):
    STANDALONE = "standalone"
    """Not replicated (``replicas=1``): serves clients, forwards nothing."""
    PRIMARY = "primary"
    BACKUP = "backup"


@dataclass(frozen=True)
class ReplicaConfig:
    """What the coordinator decided for this server: its role in the group at ``epoch`` and, for
    a primary, the backups it forwards every write to."""

    epoch: int = 0
    role: ReplicaRole = ReplicaRole.STANDALONE
    backups: tuple[str, ...] = ()
    joining: tuple[str, ...] = ()
    """Those of ``backups`` being copied into (``Replica.copy_to``): they get only the writes to
    shards copied so far, and count as in sync only once the copy is done."""
