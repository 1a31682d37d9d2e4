"""The vocabulary every paramserve process shares: what a variable, a shard, a row gradient and an
optimizer are, the typed errors, the one translation to and from the wire, raw tensor bytes and
chunked streams, partitioners and initializers.

May import: nothing of paramserve (torch, numpy and the generated wire code only). Every other
package may import it.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.protocol.errors import InvalidRequestError, ParamServeError
    from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
    from paramserve.psserver.protocol.partition import Partitioner
    from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole
    from paramserve.psserver.protocol.types import ClusterContext, RowGradient, ShardRef, ShardState, VariableLayout

__all__ = [
    "ClusterContext",
    "InvalidRequestError",
    "OptimizerSpec",
    "ParamServeError",
    "Partitioner",
    "ReplicaConfig",
    "ReplicaRole",
    "RowGradient",
    "ShardRef",
    "ShardState",
    "VariableLayout",
]

_HOMES = {
    "ClusterContext": "types",
    "InvalidRequestError": "errors",
    "OptimizerSpec": "optimizer_spec",
    "ParamServeError": "errors",
    "Partitioner": "partition",
    "ReplicaConfig": "replica_config",
    "ReplicaRole": "replica_config",
    "RowGradient": "types",
    "ShardRef": "types",
    "ShardState": "types",
    "VariableLayout": "types",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
