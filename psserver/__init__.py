"""The parameter server: holds partitioned variables and applies optimizer updates.

``build_server`` runs one in-process; ``ParameterServerClient`` is the one
client of a cluster's servers (used by workers and the coordinator).
"""

from paramserve.psserver.client import ClientConfig, ParameterServerClient
from paramserve.psserver.optimizer import OptimizerSpec
from paramserve.psserver.partition import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
)
from paramserve.psserver.server import ParameterServer, ServerConfig, build_server
from paramserve.psserver.types import RowGradient, VariableLayout

__all__ = [
    "ClientConfig",
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "OptimizerSpec",
    "ParameterServer",
    "ParameterServerClient",
    "RowGradient",
    "ServerConfig",
    "VariableLayout",
    "build_server",
]
