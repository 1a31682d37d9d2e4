"""One parameter server's state, with no grpc: shards of variables under their own locks, their
optimizers (torch.optim itself), the idempotency windows that make pushes exactly-once, and
growing tables. Every request is validated whole before anything changes.

May import: ``protocol``, ``dynamic``, ``runtime``.
"""

from paramserve.psserver.protocol.lazy import lazy_attributes

TYPE_CHECKING = False  # not typing's: a package's import stays free of it
if TYPE_CHECKING:
    from paramserve.psserver.store.dynamic_table import DynamicTables
    from paramserve.psserver.store.optimizer import ShardOptimizer
    from paramserve.psserver.store.shard_store import ShardPush, ShardStore, StoreConfig
    from paramserve.psserver.store.shards import Shard

__all__ = [
    "DynamicTables",
    "Shard",
    "ShardOptimizer",
    "ShardPush",
    "ShardStore",
    "StoreConfig",
]

_HOMES = {
    "DynamicTables": "dynamic_table",
    "Shard": "shards",
    "ShardOptimizer": "optimizer",
    "ShardPush": "shard_store",
    "ShardStore": "shard_store",
    "StoreConfig": "shard_store",
}

__getattr__ = lazy_attributes(__name__, _HOMES)
