"""Tampered and damaged checkpoints on real processes: a restore reads nothing outside the
checkpoint root, refuses a file whose bytes or chain are not the ones saved, a tensor that does
not fit the model, a delta whose ids repeat, always with a CheckpointError naming the file, and
leaves every parameter server and every worker's dense replica as they were.

Two clusters, each started once for the module: one parameter server with ``--checkpoint-root``
(its Save and Restore RPCs), and hybrid training (``sync_dense=True``: the dense layer replicated
on two workers, a DynamicEmbedding on two servers) with two chains of incremental checkpoints,
A (a full save and a delta) and B (another full save and delta, of the same table later on)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from paramserve.coordinator import CheckpointManager, ClusterCoordinator, ParameterServerStrategy
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.protocol.errors import CheckpointError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef, ShardState
from tests.integration.test_dynamic_embedding import Clicks, ClickStream, train_step

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

pytestmark = pytest.mark.timeout(300)
SGD = OptimizerSpec("SGD", {"lr": 0.1})
MANIFEST = checkpoint.MANIFEST


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_manifest(path: Path, edit) -> None:
    raw = json.loads((path / MANIFEST).read_text())
    edit(raw)
    (path / MANIFEST).write_text(json.dumps(raw))


def reseal(path: Path) -> None:
    """Every hash a manifest names made the hash of its file as it is now, as a careful forger
    would (a manifest written before files were hashed names none)."""

    def edit(raw):
        items = [s for v in raw["variables"].values() for s in v["shards"]]
        items += [f for t in raw["extra"].get("dynamic_tables", {}).values() for f in t["files"]]
        items += [raw["extra"]["dense_state"]] if "dense_state" in raw["extra"] else []
        for item in items:
            if "sha256" in item and (path / item["file"]).exists():
                item["sha256"] = sha256(path / item["file"])

    edit_manifest(path, edit)


def rewrite(file: Path, contents) -> None:
    file.unlink()
    torch.save(contents, file)


# ---------------------------------------------------------------- a server's checkpoint root


@pytest.fixture(scope="module")
def rooted(tmp_path_factory):
    """A parameter server that saves and restores under its --checkpoint-root only, holding
    ``w``; and a checkpoint outside that root whose ``w`` is all 42."""
    base = tmp_path_factory.mktemp("rooted")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    cluster = LocalCluster(num_ps=1, num_workers=0, extra_ps_args=("--checkpoint-root", str(root)))
    cluster.start()
    client = ParameterServerClient(list(cluster.parameter_servers), ClientConfig(call_timeout=30.0))
    try:
        value = torch.arange(8.0).reshape(4, 2)
        client.create_variable("w", value, optimizer=SGD)
        secret = ShardState(ShardRef("w", 0), (4, 2), 0, torch.full((4, 2), 42.0), SGD)
        saved = checkpoint.save_checkpoint(outside, [secret])
        secret_file = next(saved.glob("*.pt"))
        yield client, root, secret_file, value
    finally:
        client.close()
        cluster.stop()


def saved_on_server(client, root: Path, name: str) -> tuple[Path, Path]:
    """A new checkpoint of the server's shards under ``root/name``: its directory and shard file."""
    client.save(name)
    path = checkpoint.latest_checkpoint(root / name / "ps-0")
    assert path is not None
    return path, next(path.glob("*.pt"))


def assert_server_unchanged(client, value):
    pulled = client.pull(["w"])
    assert torch.equal(pulled.tensors["w"], value), "the refused restore changed the variable"


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_shard_file_named_outside_the_root_is_refused_by_the_server(rooted, how):
    client, root, secret, value = rooted
    path, shard = saved_on_server(client, root, f"named-{how}")
    name = os.path.relpath(secret, path) if how == "dotdot" else str(secret)

    def point_outside(raw):
        entry = raw["variables"]["w"]["shards"][0]
        entry["file"] = name
        if "sha256" in entry:  # the forger names the right hash
            entry["sha256"] = sha256(secret)

    edit_manifest(path, point_outside)
    with pytest.raises(CheckpointError, match="not a plain name in the checkpoint's directory") as caught:
        client.restore(f"named-{how}/ps-0/{path.name}", list(client.layouts.values()))
    assert repr(name) in str(caught.value)
    assert_server_unchanged(client, value)


def test_a_shard_file_linked_outside_the_root_is_refused_by_the_server(rooted):
    client, root, secret, value = rooted
    path, shard = saved_on_server(client, root, "linked")
    shard.unlink()
    shard.symlink_to(secret)
    reseal(path)
    with pytest.raises(CheckpointError, match="is a symbolic link") as caught:
        client.restore(f"linked/ps-0/{path.name}", list(client.layouts.values()))
    assert shard.name in str(caught.value)
    assert_server_unchanged(client, value)


# ---------------------------------------------------------------- hybrid training, two chains


class Hybrid:
    """The module's hybrid-training cluster, its strategy and coordinator, and two checkpoint
    chains of the same run: ``a`` (ckpt-1 full, ckpt-2 a delta of it) and ``b`` (the same,
    saved later)."""

    def __init__(self, base: Path):
        self.cluster = LocalCluster(num_ps=2, num_workers=2)
        self.cluster.start()
        self.strategy = ParameterServerStrategy(self.cluster.spec, sync_dense=True)
        torch.manual_seed(0)
        with self.strategy.scope():
            self.model = Clicks()
            self.optimizer = torch.optim.Adagrad(self.model.parameters(), lr=0.2)
        self.coordinator = ClusterCoordinator(self.strategy)
        self.batches = iter(self.coordinator.create_per_worker_dataset(ClickStream()))
        self.a, self.b = base / "a", base / "b"
        chain_a = CheckpointManager(self.strategy, self.a, full_every=3)
        chain_b = CheckpointManager(self.strategy, self.b, full_every=3)
        for manager, step in ((chain_a, 20), (chain_a, 40), (chain_b, 60), (chain_b, 80)):
            self.train(20)
            manager.save(step)
        for chain in (self.a, self.b):
            assert checkpoint.read_manifest(chain / "ckpt-00000002").needs == ("ckpt-00000001",), "a delta"
        self.base = base

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.coordinator.schedule(train_step, args=(self.batches, self.model, self.optimizer))
        self.coordinator.join(timeout=120)

    def copy_of_a(self, name: str) -> Path:
        """A copy of chain A to tamper with; returns its newest checkpoint (the delta)."""
        target = self.base / name
        shutil.copytree(self.a, target, symlinks=True)
        return target / "ckpt-00000002"

    def restore(self, path: Path) -> int:
        return CheckpointManager(self.strategy, path.parent).restore(path)

    def snapshot(self) -> dict:
        """What a restore changes: every server's table shard, every worker's dense replica and
        the coordinator's own dense values."""
        tables = self.strategy.client.dynamic.export(["ids"])
        return {
            "tables": {
                server: [(s.ids.clone(), s.values.clone(), s.version) for s in states]
                for server, states in tables.items()
            },
            "replicas": replicas(self.coordinator, self.model, 2),
            "coordinator": {name: p.detach().clone() for name, p in self.model.named_parameters()},
        }

    def close(self) -> None:
        self.coordinator.shutdown()
        self.strategy.close()
        self.cluster.stop()


def replica_of(model):
    return os.getpid(), {name: p.detach().clone() for name, p in model.named_parameters()}


def replicas(coordinator, model, workers):
    """Every worker's dense replica: one closure per worker in one round (a round gives each one)."""
    coordinator.join(timeout=120)
    with coordinator.paused(timeout=60):  # queued together: one round takes them all
        values = [coordinator.schedule(replica_of, args=(model,)) for _ in range(workers)]
    coordinator.join(timeout=120)
    found = dict(v.fetch() for v in values)
    assert len(found) == workers, "each worker of the round ran one closure"
    return [found[pid] for pid in sorted(found)]


def assert_same(before, after):
    assert before["tables"].keys() == after["tables"].keys()
    for server, shards in before["tables"].items():
        for (ids, values, version), (ids2, values2, version2) in zip(shards, after["tables"][server]):
            assert torch.equal(ids, ids2) and torch.equal(values, values2) and version == version2, server
    for old, new in zip(before["replicas"] + [before["coordinator"]], after["replicas"] + [after["coordinator"]]):
        assert old.keys() == new.keys()
        assert all(torch.equal(old[name], new[name]) for name in old), "a dense replica changed"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    run = Hybrid(tmp_path_factory.mktemp("hybrid"))
    try:
        assert run.restore(run.copy_of_a("untampered")) == 40, "an untampered copy restores"
        yield run
    finally:
        run.close()


def refused(run: Hybrid, path: Path, match: str) -> CheckpointError:
    """The restore of ``path`` raises a CheckpointError matching ``match``, and changes nothing."""
    before = run.snapshot()
    with pytest.raises(CheckpointError, match=match) as caught:
        run.restore(path)
    assert_same(before, run.snapshot())
    return caught.value


def delta_file(path: Path, shard: int) -> Path:
    files = json.loads((path / MANIFEST).read_text())["extra"]["dynamic_tables"]["ids"]["files"]
    return path / next(item["file"] for item in files if item["shard"] == shard)


def test_a_dense_state_of_another_shape_is_refused_not_broadcast(hybrid):
    path = hybrid.copy_of_a("narrow")
    state = torch.load(path / "dense_state.pt", weights_only=True)
    state["values"]["clicks.out.weight"] = torch.full((1, 1), 0.5)  # the model's is (1, 8)
    rewrite(path / "dense_state.pt", state)
    reseal(path)
    error = refused(hybrid, path, r"holds 'clicks.out.weight' as \(1, 1\) torch.float32; the model's is \(1, 8\)")
    assert "dense_state.pt" in str(error)


def test_a_delta_with_a_flipped_byte_is_refused(hybrid):
    path = hybrid.copy_of_a("flipped")
    file = delta_file(path, 0)
    values = torch.load(file, weights_only=True)["values"]
    data = bytearray(file.read_bytes())
    at = bytes(data).find(values.numpy().tobytes())  # a byte of the rows' values, not of the zip
    assert at > 0
    data[at + 2] ^= 0x10
    file.write_bytes(bytes(data))
    error = refused(hybrid, path, "does not match its manifest")
    assert file.name in str(error)


def test_a_delta_from_another_run_or_chain_is_refused(hybrid):
    """Chain B's delta beside chain A's base: the same shards, so the same lineages (the hardest
    case; tests/unit/test_checkpoint_integrity.py has one of another lineage): its parent's hash differs."""
    path = hybrid.copy_of_a("foreign")
    shutil.rmtree(path)
    shutil.copytree(hybrid.b / "ckpt-00000002", path)  # B's delta, of B's ckpt-1, beside A's ckpt-1
    refused(hybrid, path, "a delta of another run or chain")


def test_a_delta_with_repeated_ids_is_refused_before_any_server_or_worker_changes(hybrid):
    path = hybrid.copy_of_a("repeated")
    file = delta_file(path, 1)
    saved = torch.load(file, weights_only=True)
    assert saved["ids"].numel() > 0
    for key in ("ids", "values", "updated"):
        saved[key] = torch.cat([saved[key], saved[key][-1:]])
    saved["slots"] = {key: torch.cat([value, value[-1:]]) for key, value in saved["slots"].items()}
    rewrite(file, saved)
    reseal(path)
    error = refused(hybrid, path, r"ids that are not sorted and distinct \(1 repeated\)")
    assert file.name in str(error)


def _forbidden() -> dict:
    return {"values": {}, "version": 0, "optimizer": None, "applied": [], "why": Path("/etc/passwd")}


@pytest.mark.parametrize("damage", ["dense-not-weights", "dense-unbroadcastable", "delta-not-torch"])
def test_every_refusal_is_a_checkpoint_error(hybrid, damage):
    path = hybrid.copy_of_a(damage)
    if damage == "dense-not-weights":  # a pickle naming a class weights_only refuses
        buffer = io.BytesIO()
        torch.save(_forbidden(), buffer)
        (path / "dense_state.pt").write_bytes(buffer.getvalue())
    elif damage == "dense-unbroadcastable":
        state = torch.load(path / "dense_state.pt", weights_only=True)
        state["values"]["clicks.out.weight"] = torch.ones(2, 3)
        rewrite(path / "dense_state.pt", state)
    else:
        delta_file(path, 0).write_bytes(b"not a torch file")
    reseal(path)
    error = refused(hybrid, path, "cannot be read|the model's is")
    assert ("dense_state.pt" if damage.startswith("dense") else delta_file(path, 0).name) in str(error)
