"""What a training step means on a parameter server, whichever transport brings it (a ``Step``
RPC, a data-plane frame, a compiled step program): a push under one idempotency key and the reads
answered once it is applied.

May import: ``protocol``, ``dynamic``, ``store``, ``dataplane``, ``runtime``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.steps.engine import StepEngine, StepLimits
    from paramserve.psserver.steps.programs import StepPrograms

__all__ = [
    "StepEngine",
    "StepLimits",
    "StepPrograms",
]

_HOMES = {
    "StepEngine": "engine",
    "StepLimits": "engine",
    "StepPrograms": "programs",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
