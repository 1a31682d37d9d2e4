"""The parameter server: holds partitioned variables and applies optimizer updates.

``build_server`` runs one in-process; ``ParameterServerClient`` is the one
client of a cluster's servers (used by workers and the coordinator).

The names below are imported when first used (PEP 562), not when the package is:
importing any ``paramserve.psserver.*`` module runs this file first, and the
container health probe (``health_probe``) must start without torch.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # not typing's: importing typing costs a health probe ~25 ms of CPU
if TYPE_CHECKING:
    from typing import Any

    from paramserve.psserver.client import ClientConfig, ParameterServerClient
    from paramserve.psserver.optimizer_spec import OptimizerSpec
    from paramserve.psserver.partition import (
        FixedShardsPartitioner,
        MaxSizePartitioner,
        MinSizePartitioner,
    )
    from paramserve.psserver.server import ParameterServer, ServerConfig, build_server
    from paramserve.psserver.types import RowGradient, VariableLayout

_HOMES = {
    "ClientConfig": "client",
    "FixedShardsPartitioner": "partition",
    "MaxSizePartitioner": "partition",
    "MinSizePartitioner": "partition",
    "OptimizerSpec": "optimizer",
    "ParameterServer": "server",
    "ParameterServerClient": "client",
    "RowGradient": "types",
    "ServerConfig": "server",
    "VariableLayout": "types",
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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
