"""Models and data the demo, the examples, the tests and the benchmarks share: the digits
classifier, a recommendation model and its synthetic data, the examples' helpers.

May import: everything of the coordinator below it (strategies, training).
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches

__all__ = [
    "MLP",
    "digits_split",
    "train_step",
    "worker_batches",
]

_HOMES = {
    "MLP": "digits",
    "digits_split": "digits",
    "train_step": "digits",
    "worker_batches": "digits",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
