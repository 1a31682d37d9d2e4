"""The parameter server: holds partitioned variables and applies optimizer updates.

``build_server`` runs one in-process; ``ParameterServerClient`` is the one
client of a cluster's servers (used by workers and the coordinator).

The names below are imported when first used (PEP 562), not when the package is:
importing any ``paramserve.psserver.*`` module runs this file first, and the
container health probe (``health_probe``) must start without torch.
"""

from __future__ import annotations

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: importing typing costs a health probe ~25 ms of CPU
if TYPE_CHECKING:
    from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
    from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
    from paramserve.psserver.protocol.partition import (
        FixedShardsPartitioner,
        MaxSizePartitioner,
        MinSizePartitioner,
    )
    from paramserve.psserver.protocol.types import RowGradient, VariableLayout
    from paramserve.psserver.server import ParameterServer, ServerConfig, build_server

_HOMES = {
    "ClientConfig": "client.ps_client",
    "FixedShardsPartitioner": "protocol.partition",
    "MaxSizePartitioner": "protocol.partition",
    "MinSizePartitioner": "protocol.partition",
    "OptimizerSpec": "protocol.optimizer_spec",
    "ParameterServer": "server",
    "ParameterServerClient": "client.ps_client",
    "RowGradient": "protocol.types",
    "ServerConfig": "server",
    "VariableLayout": "protocol.types",
    "build_server": "server",
}

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


__getattr__ = lazy_attributes(__name__, _HOMES)
