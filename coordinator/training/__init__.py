"""Keras-style training under any strategy: ``fit``, ``evaluate``, ``predict`` and their callbacks."""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.training.loops import evaluate, fit, predict


__all__ = ["evaluate", "fit", "predict"]

_HOMES = {
    "evaluate": "loops",
    "fit": "loops",
    "predict": "loops",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
