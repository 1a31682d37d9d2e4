"""What makes a coordinator's export a whole checkpoint (coordinator/checkpointing/checkpoint_manager.py's
pure checks): every shard of the layouts exported, no server restarted during the export."""

from __future__ import annotations

import torch

from paramserve.coordinator.checkpointing.checkpoint_manager import changed_servers, missing_shards
from paramserve.psserver.protocol.types import ShardPlacement, ShardRef, VariableLayout

LAYOUTS = {
    "w": VariableLayout("w", (4, 2), torch.float32, (ShardPlacement(0, 0, 0, 2), ShardPlacement(1, 1, 2, 2))),
    "b": VariableLayout("b", (2,), torch.float32, (ShardPlacement(0, 1, 0, 2),)),
}


def test_every_shard_exported_is_whole():
    assert missing_shards(LAYOUTS, [ShardRef("w", 0), ShardRef("w", 1), ShardRef("b", 0)]) == []


def test_shards_a_restarted_server_no_longer_holds_are_missing_with_their_server():
    assert missing_shards(LAYOUTS, [ShardRef("w", 0)]) == [(1, ShardRef("w", 1)), (1, ShardRef("b", 0))]


def test_other_variables_exported_do_not_count():
    exported = [ShardRef("w", 0), ShardRef("w", 1), ShardRef("other-run/x", 0)]
    assert missing_shards(LAYOUTS, exported) == [(1, ShardRef("b", 0))]


def test_a_server_whose_incarnation_changed_during_the_export_restarted():
    assert changed_servers(["a", "b"], ["a", "c"]) == [1]
    assert changed_servers(["a", None], ["a", "c"]) == [], "one that did not answer before: nothing to compare"
    assert changed_servers(["a", "b"], ["a", "b"]) == []
