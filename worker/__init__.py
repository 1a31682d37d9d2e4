"""The worker: runs the closures a ClusterCoordinator schedules, reading and updating
distributed variables on the parameter servers."""

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
