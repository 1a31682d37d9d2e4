"""tf.distribute's Strategy API in PyTorch idiom: the same training code runs on one
device, mirrored across local devices, with central variable storage, across
processes on torch.distributed, or against variables on parameter servers."""

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
