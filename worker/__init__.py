"""The worker: runs the closures a ClusterCoordinator schedules, reading and updating
distributed variables on the parameter servers."""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.worker.dynamic_embedding import DynamicEmbedding
    from paramserve.worker.layers import ServerOptimizer, ShardedEmbedding, ShardedEmbeddingCollection
    from paramserve.worker.resources import PerWorkerResource, WorkerContext
    from paramserve.worker.server import WorkerConfig, build_worker


__all__ = [
    "DynamicEmbedding",
    "PerWorkerResource",
    "ServerOptimizer",
    "ShardedEmbedding",
    "ShardedEmbeddingCollection",
    "WorkerConfig",
    "WorkerContext",
    "build_worker",
]

_HOMES = {
    "DynamicEmbedding": "dynamic_embedding",
    "PerWorkerResource": "resources",
    "ServerOptimizer": "layers",
    "ShardedEmbedding": "layers",
    "ShardedEmbeddingCollection": "layers",
    "WorkerConfig": "server",
    "WorkerContext": "resources",
    "build_worker": "server",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
