"""The user's program: ParameterServerStrategy, ClusterCoordinator, checkpoints, the local launcher.

``metrics`` is imported when first used (``from paramserve.coordinator import metrics``, or
the attribute): it brings torchmetrics, about a second of every process's start that a program
without metrics (a server started by the ``paramserve`` command, a launcher) never needs.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.checkpointing.checkpoint_manager import (
        CheckpointManager,
        export_state_dict,
        load_state_dict,
        state_dict,
    )
    from paramserve.coordinator.cluster import ClusterSpec
    from paramserve.coordinator.cluster_coordinator import ClusterCoordinator, CoordinatorConfig
    from paramserve.coordinator.cluster_resolver import (
        ClusterJobs,
        ClusterResolver,
        KubernetesClusterResolver,
        SimpleClusterResolver,
        TFConfigClusterResolver,
    )
    from paramserve.coordinator.dispatch.discovery import DiscoveryPolicy
    from paramserve.coordinator.dispatch.failures import FailurePolicy
    from paramserve.coordinator.errors import (
        ClosureError,
        OutOfRangeError,
        ParameterServerUnavailableError,
    )
    from paramserve.coordinator.local_cluster import LocalCluster
    from paramserve.coordinator.recovery.recovery_policy import RecoveryPoint, RecoveryPolicy
    from paramserve.coordinator.remote_value import PerWorkerValues, RemoteValue, RemoteValueState
    from paramserve.coordinator.sidecar_evaluator import SidecarEvaluator, load_checkpoint_weights
    from paramserve.coordinator.strategies import (
        CentralStorageStrategy,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        ReduceOp,
        compute_average_loss,
        experimental_set_strategy,
        get_strategy,
    )
    from paramserve.coordinator.strategies.input import DatasetCreator
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
    from paramserve.coordinator.training import callbacks
    from paramserve.coordinator.training.callbacks import latest_checkpoint
    from paramserve.coordinator.training.loops import evaluate, fit, predict
    from paramserve.psserver.protocol.partition import (
        FixedShardsPartitioner,
        MaxSizePartitioner,
        MinSizePartitioner,
        Partitioner,
    )
    from paramserve.worker.dynamic_embedding import DynamicEmbedding
    from paramserve.worker.layers import ShardedEmbedding, ShardedEmbeddingCollection
    from paramserve.worker.resources import experimental_get_current_worker_index


__all__ = [
    "CentralStorageStrategy",
    "CheckpointManager",
    "ClosureError",
    "ClusterCoordinator",
    "ClusterSpec",
    "CoordinatorConfig",
    "DiscoveryPolicy",
    "DynamicEmbedding",
    "FailurePolicy",
    "FixedShardsPartitioner",
    "LocalCluster",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "OutOfRangeError",
    "ParameterServerStrategy",
    "ParameterServerUnavailableError",
    "RecoveryPoint",
    "RecoveryPolicy",
    "ReduceOp",
    "RemoteValue",
    "RemoteValueState",
    "ShardedEmbedding",
    "ShardedEmbeddingCollection",
    "SidecarEvaluator",
    "callbacks",
    "compute_average_loss",
    "evaluate",
    "export_state_dict",
    "fit",
    "get_strategy",
    "latest_checkpoint",
    "load_checkpoint_weights",
    "load_state_dict",
    "metrics",
    "predict",
    "state_dict",
    # TensorFlow's names of issue #22: cluster resolvers, per-worker values, dataset creators
    "ClusterJobs",
    "ClusterResolver",
    "DatasetCreator",
    "KubernetesClusterResolver",
    "Partitioner",
    "PerWorkerValues",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "experimental_get_current_worker_index",
    "experimental_set_strategy",
]

_HOMES = {
    "CentralStorageStrategy": "strategies",
    "CheckpointManager": "checkpointing.checkpoint_manager",
    "ClosureError": "errors",
    "ClusterCoordinator": "cluster_coordinator",
    "ClusterJobs": "cluster_resolver",
    "ClusterResolver": "cluster_resolver",
    "ClusterSpec": "cluster",
    "CoordinatorConfig": "cluster_coordinator",
    "DatasetCreator": "strategies.input",
    "DiscoveryPolicy": "dispatch.discovery",
    "DynamicEmbedding": "paramserve.worker.dynamic_embedding",
    "FailurePolicy": "dispatch.failures",
    "FixedShardsPartitioner": "paramserve.psserver.protocol.partition",
    "KubernetesClusterResolver": "cluster_resolver",
    "LocalCluster": "local_cluster",
    "MaxSizePartitioner": "paramserve.psserver.protocol.partition",
    "MinSizePartitioner": "paramserve.psserver.protocol.partition",
    "MirroredStrategy": "strategies",
    "MultiWorkerMirroredStrategy": "strategies",
    "OneDeviceStrategy": "strategies",
    "OutOfRangeError": "errors",
    "ParameterServerStrategy": "strategies.parameter_server",
    "ParameterServerUnavailableError": "errors",
    "Partitioner": "paramserve.psserver.protocol.partition",
    "PerWorkerValues": "remote_value",
    "RecoveryPoint": "recovery.recovery_policy",
    "RecoveryPolicy": "recovery.recovery_policy",
    "ReduceOp": "strategies",
    "RemoteValue": "remote_value",
    "RemoteValueState": "remote_value",
    "ShardedEmbedding": "paramserve.worker.layers",
    "ShardedEmbeddingCollection": "paramserve.worker.layers",
    "SidecarEvaluator": "sidecar_evaluator",
    "SimpleClusterResolver": "cluster_resolver",
    "TFConfigClusterResolver": "cluster_resolver",
    "compute_average_loss": "strategies",
    "evaluate": "training.loops",
    "experimental_get_current_worker_index": "paramserve.worker.resources",
    "experimental_set_strategy": "strategies",
    "export_state_dict": "checkpointing.checkpoint_manager",
    "fit": "training.loops",
    "get_strategy": "strategies",
    "latest_checkpoint": "training.callbacks",
    "load_checkpoint_weights": "sidecar_evaluator",
    "load_state_dict": "checkpointing.checkpoint_manager",
    "predict": "training.loops",
    "state_dict": "checkpointing.checkpoint_manager",
}

_MODULES = {"callbacks": "training.callbacks", "metrics": "metrics"}

__getattr__ = lazy_attributes(__name__, _HOMES, _MODULES)
