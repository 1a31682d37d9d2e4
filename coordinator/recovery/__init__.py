"""Failed parameter servers come back: the pure recovery policy (when to restore, from which
checkpoint), the recovery loop that restores a server, and replica groups (which member is
primary, which backups hold its state).

May import: the coordinator's base, ``dispatch``, ``checkpointing``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.recovery.ps_recovery import ParameterServerRecovery, RecoverableVariables
    from paramserve.coordinator.recovery.recovery_policy import RecoveryPoint, RecoveryPolicy
    from paramserve.coordinator.recovery.replica_groups import ParameterServers

__all__ = [
    "ParameterServerRecovery",
    "ParameterServers",
    "RecoverableVariables",
    "RecoveryPoint",
    "RecoveryPolicy",
]

_HOMES = {
    "ParameterServerRecovery": "ps_recovery",
    "ParameterServers": "replica_groups",
    "RecoverableVariables": "ps_recovery",
    "RecoveryPoint": "recovery_policy",
    "RecoveryPolicy": "recovery_policy",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
