"""tf.distribute's Strategy API in PyTorch idiom: the same training code runs on one
device, mirrored across local devices, with central variable storage, across
processes on torch.distributed, or against variables on parameter servers."""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.coordinator.strategies.base import (
        InputContext,
        ReduceOp,
        ReplicaContext,
        Strategy,
        experimental_set_strategy,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from paramserve.coordinator.strategies.central_storage import CentralStorageStrategy
    from paramserve.coordinator.strategies.cross_device_ops import (
        CrossDeviceOps,
        HierarchicalCopyAllReduce,
        NcclAllReduce,
        ReductionToOneDevice,
    )
    from paramserve.coordinator.strategies.distributed_values import (
        DistributedValues,
        Mirrored,
        PerReplica,
        SyncOnReadVariable,
        ValueContext,
        VariableAggregation,
    )
    from paramserve.coordinator.strategies.extended import StrategyExtended
    from paramserve.coordinator.strategies.input import (
        DatasetCreator,
        DistributedDataset,
        InputOptions,
        InputReplicationMode,
    )
    from paramserve.coordinator.strategies.iterators import DistributedIterator, OptionalElement, TensorSpec
    from paramserve.coordinator.strategies.losses import (
        compute_average_loss,
        scale_regularization_loss,
    )
    from paramserve.coordinator.strategies.mirrored import MirroredStrategy, OneDeviceStrategy
    from paramserve.coordinator.strategies.multi_worker import MultiWorkerMirroredStrategy
    from paramserve.coordinator.strategies.multi_worker_cluster import (
        CollectiveCommunication,
        CommunicationImplementation,
        CommunicationOptions,
    )
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy


__all__ = [
    # the API every strategy implements
    "Strategy",
    "ReduceOp",
    "ReplicaContext",
    "InputContext",
    "InputOptions",
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "in_cross_replica_context",
    # in-process strategies
    "OneDeviceStrategy",
    "MirroredStrategy",
    "CentralStorageStrategy",
    # across processes (torch.distributed)
    "MultiWorkerMirroredStrategy",
    "CommunicationOptions",
    "CollectiveCommunication",
    "CommunicationImplementation",
    # variables on parameter servers (with ClusterCoordinator)
    "ParameterServerStrategy",
    # distributed values
    "PerReplica",
    "DistributedValues",
    "DistributedDataset",
    "Mirrored",
    "SyncOnReadVariable",
    "VariableAggregation",
    # loss scaling
    "compute_average_loss",
    "scale_regularization_loss",
    # cross-device reduction
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    # TensorFlow's remaining Strategy API (issue #22)
    "StrategyExtended",
    "ValueContext",
    "experimental_set_strategy",
    # TensorFlow's input API (issue #22)
    "InputReplicationMode",
    "DatasetCreator",
    "DistributedIterator",
    "OptionalElement",
    "TensorSpec",
]

_HOMES = {
    "CentralStorageStrategy": "central_storage",
    "CollectiveCommunication": "multi_worker_cluster",
    "CommunicationImplementation": "multi_worker_cluster",
    "CommunicationOptions": "multi_worker_cluster",
    "CrossDeviceOps": "cross_device_ops",
    "DatasetCreator": "input",
    "DistributedDataset": "input",
    "DistributedIterator": "iterators",
    "DistributedValues": "distributed_values",
    "HierarchicalCopyAllReduce": "cross_device_ops",
    "InputContext": "base",
    "InputOptions": "input",
    "InputReplicationMode": "input",
    "Mirrored": "distributed_values",
    "MirroredStrategy": "mirrored",
    "MultiWorkerMirroredStrategy": "multi_worker",
    "NcclAllReduce": "cross_device_ops",
    "OneDeviceStrategy": "mirrored",
    "OptionalElement": "iterators",
    "ParameterServerStrategy": "parameter_server",
    "PerReplica": "distributed_values",
    "ReduceOp": "base",
    "ReductionToOneDevice": "cross_device_ops",
    "ReplicaContext": "base",
    "Strategy": "base",
    "StrategyExtended": "extended",
    "SyncOnReadVariable": "distributed_values",
    "TensorSpec": "iterators",
    "ValueContext": "distributed_values",
    "VariableAggregation": "distributed_values",
    "compute_average_loss": "losses",
    "experimental_set_strategy": "base",
    "get_replica_context": "base",
    "get_strategy": "base",
    "has_strategy": "base",
    "in_cross_replica_context": "base",
    "scale_regularization_loss": "losses",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
