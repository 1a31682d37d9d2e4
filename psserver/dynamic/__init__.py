"""Growing tables' shared data: the table's configuration and state types, the row arena and id
index both a server's table and a checkpoint use, and the wire form of a table's rows.

May import: ``protocol``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.dynamic.dynamic_rows import IdIndex, RowArena
    from paramserve.psserver.dynamic.dynamic_types import (
        DynamicSaveMark,
        DynamicShardState,
        DynamicStats,
        DynamicTableConfig,
    )

__all__ = [
    "DynamicSaveMark",
    "DynamicShardState",
    "DynamicStats",
    "DynamicTableConfig",
    "IdIndex",
    "RowArena",
]

_HOMES = {
    "DynamicSaveMark": "dynamic_types",
    "DynamicShardState": "dynamic_types",
    "DynamicStats": "dynamic_types",
    "DynamicTableConfig": "dynamic_types",
    "IdIndex": "dynamic_rows",
    "RowArena": "dynamic_rows",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
