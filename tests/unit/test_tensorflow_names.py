"""Every name a TensorFlow user ports is in docs/tensorflow_migration.md, and the table is true.

The names come from seed 004 (the ``tf.distribute`` module reference this project was created
from: its modules, classes and functions), and from the parameter-server tutorial and the
methods porting users call (``REQUIRED`` below). A row maps a TensorFlow name to the paramserve
name that implements it (which must import), or says why it is absent. Of the names that are
neither TPU-only nor deprecated, at least 90% must behave as TensorFlow documents.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "tensorflow_migration.md"
SEEDS = ROOT.parent / "shared" / "seeds"

STATUSES = {"same", "adapted", "differs", "absent"}
"""same: behaves as TF documents; adapted: PyTorch's idiom, TF's spelling accepted as well;
differs: paramserve's way only, TF's spelling refused with an error naming it (the reason is in
the row); absent: not implemented, with the reason."""
EXCLUDED = ("TPU-only", "Deprecated in TensorFlow")
"""How the notes of a name out of the count begin (no TPU runtime in PyTorch; TF deprecated it)."""

REQUIRED = (
    # the parameter-server tutorial
    "tf.distribute.experimental.ParameterServerStrategy",
    "tf.distribute.experimental.coordinator.ClusterCoordinator",
    "tf.distribute.experimental.coordinator.ClusterCoordinator.schedule",
    "tf.distribute.experimental.coordinator.ClusterCoordinator.join",
    "tf.distribute.experimental.coordinator.ClusterCoordinator.done",
    "tf.distribute.experimental.coordinator.ClusterCoordinator.fetch",
    "tf.distribute.experimental.coordinator.ClusterCoordinator.create_per_worker_dataset",
    "tf.distribute.experimental.coordinator.PerWorkerValues",
    "tf.distribute.experimental.coordinator.RemoteValue",
    "tf.distribute.experimental.coordinator.RemoteValue.fetch",
    "tf.distribute.experimental.coordinator.RemoteValue.get",
    "tf.distribute.coordinator.experimental_get_current_worker_index",
    "tf.distribute.experimental.partitioners.Partitioner",
    "tf.distribute.experimental.partitioners.FixedShardsPartitioner",
    "tf.distribute.experimental.partitioners.MinSizePartitioner",
    "tf.distribute.experimental.partitioners.MaxSizePartitioner",
    "tf.distribute.cluster_resolver.ClusterResolver",
    "tf.distribute.cluster_resolver.SimpleClusterResolver",
    "tf.distribute.cluster_resolver.TFConfigClusterResolver",
    "tf.distribute.cluster_resolver.KubernetesClusterResolver",
    "tf.distribute.cluster_resolver.TPUClusterResolver",
    "tf.train.ClusterSpec",
    "tf.keras.utils.experimental.DatasetCreator",
    "tf.keras.Model.fit",
    "tf.keras.Model.evaluate",
    "tf.keras.Model.predict",
    "tf.keras.callbacks.ModelCheckpoint",
    "tf.keras.callbacks.BackupAndRestore",
    "tf.keras.callbacks.TensorBoard",
    "tf.keras.utils.SidecarEvaluator",
    "tf.keras.metrics.Accuracy",
    "tf.keras.metrics.AUC",
    "tf.train.CheckpointManager",
    "tf.nn.compute_average_loss",
    "tf.nn.scale_regularization_loss",
    # the rest of the Strategy API porting users call
    "tf.distribute.Strategy.scope",
    "tf.distribute.Strategy.run",
    "tf.distribute.Strategy.reduce",
    "tf.distribute.Strategy.gather",
    "tf.distribute.Strategy.extended",
    "tf.distribute.Strategy.cluster_resolver",
    "tf.distribute.Strategy.num_replicas_in_sync",
    "tf.distribute.Strategy.experimental_local_results",
    "tf.distribute.Strategy.experimental_distribute_dataset",
    "tf.distribute.Strategy.distribute_datasets_from_function",
    "tf.distribute.Strategy.experimental_distribute_values_from_function",
    "tf.distribute.Strategy.experimental_distribute_datasets_from_function",
    "tf.distribute.Strategy.experimental_run_v2",
    "tf.distribute.Strategy.make_experimental_numpy_dataset",
    "tf.distribute.StrategyExtended.update",
    "tf.distribute.StrategyExtended.reduce_to",
    "tf.distribute.StrategyExtended.batch_reduce_to",
    "tf.distribute.StrategyExtended.worker_devices",
    "tf.distribute.StrategyExtended.parameter_devices",
    "tf.distribute.StrategyExtended.colocate_vars_with",
    "tf.distribute.StrategyExtended.value_container",
    "tf.distribute.StrategyExtended.variable_created_in_scope",
    "tf.distribute.ReplicaContext.all_reduce",
    "tf.distribute.ReplicaContext.all_gather",
    "tf.distribute.ReplicaContext.merge_call",
    "tf.distribute.ReplicaContext.num_replicas_in_sync",
    "tf.distribute.ReplicaContext.replica_id_in_sync_group",
    "tf.distribute.DistributedIterator.get_next",
    "tf.distribute.DistributedIterator.get_next_as_optional",
    "tf.distribute.DistributedIterator.element_spec",
    "tf.distribute.InputContext.get_per_replica_batch_size",
    "tf.distribute.InputContext.input_pipeline_id",
    "tf.distribute.InputContext.num_input_pipelines",
    "tf.distribute.InputOptions.experimental_fetch_to_device",
    "tf.distribute.InputOptions.experimental_replication_mode",
    "tf.distribute.InputOptions.experimental_place_dataset_on_device",
    "tf.distribute.InputOptions.experimental_per_replica_buffer_size",
    "tf.distribute.experimental.CentralStorageStrategy",
    "tf.distribute.experimental.MultiWorkerMirroredStrategy",
    "tf.distribute.experimental.CommunicationOptions",
    "tf.distribute.experimental.CommunicationImplementation",
    "tf.distribute.experimental.CollectiveCommunication",
    "tf.distribute.experimental.ValueContext",
    "tf.distribute.experimental.TPUStrategy",
    "tf.distribute.MirroredStrategy.cross_device_ops",
    "tf.distribute.NcclAllReduce.num_packs",
    "tf.distribute.experimental.VariableAggregation",
    "tf.distribute.experimental.SyncOnReadVariable",
)


@dataclass(frozen=True)
class Row:
    tensorflow: str
    paramserve: tuple[str, ...]
    status: str
    notes: str


def table_rows() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`tf."):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} has two rows"
        rows[name] = Row(name, tuple(re.findall(r"`(paramserve[\w.]*(?:\(\w+\))?)`", cells[1])), cells[2], cells[3])
    return rows


def seed_names() -> list[str]:
    """The public names seed 004's module reference lists: modules, classes and functions."""
    [seed] = SEEDS.glob("004_*.txt")
    names = []
    for line in seed.read_text().splitlines():
        match = re.match(r"^(?:class (\w+):|(\w+)\(\.\.\.\):|(\w+) module:)", line.strip())
        if match:
            names.append("tf.distribute." + next(group for group in match.groups() if group))
    return names


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes; a path
    ending in ``(name)`` names a parameter of the callable before it."""
    argument = re.fullmatch(r"(.*)\((\w+)\)", path)
    if argument is not None:
        found = resolve(argument.group(1))
        parameters = inspect.signature(found).parameters  # type: ignore[arg-type]
        if argument.group(2) not in parameters:
            raise AttributeError(f"{argument.group(1)} takes no parameter {argument.group(2)!r}")
        return parameters[argument.group(2)]
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(path)


def test_seed_004_lists_the_module_reference_names():
    if not SEEDS.is_dir():
        pytest.skip(f"the seeds are not beside the repository ({SEEDS})")
    names = seed_names()
    assert len(names) == 27 and "tf.distribute.StrategyExtended" in names and "tf.distribute.has_strategy" in names


def test_every_name_a_porting_user_looks_for_has_a_row():
    required = set(REQUIRED) | (set(seed_names()) if SEEDS.is_dir() else set())
    missing = sorted(required - set(table_rows()))
    assert not missing, f"add rows to {TABLE.name} for: {missing}"


def test_every_row_is_implemented_or_says_why_not():
    problems = []
    for row in table_rows().values():
        if row.status not in STATUSES:
            problems.append(f"{row.tensorflow}: status {row.status!r} is not one of {sorted(STATUSES)}")
        elif row.status == "absent":
            if row.paramserve or len(row.notes) < 15:
                problems.append(f"{row.tensorflow}: an absent name gives its reason and no paramserve name")
        elif not row.paramserve:
            problems.append(f"{row.tensorflow}: names no paramserve implementation")
        elif row.status == "differs" and len(row.notes) < 15:
            problems.append(f"{row.tensorflow}: a difference gives its reason")
        for path in row.paramserve:
            try:
                resolve(path)
            except (ImportError, AttributeError) as exc:
                problems.append(f"{row.tensorflow}: {path} does not resolve ({exc})")
    assert not problems, "\n".join(problems)


def test_nine_in_ten_of_the_names_that_count_behave_as_tensorflow_documents():
    counted = [r for r in table_rows().values() if not r.notes.startswith(EXCLUDED)]
    behave = [r for r in counted if r.status in ("same", "adapted")]
    assert len(behave) >= 0.9 * len(counted), (
        f"{len(behave)} of {len(counted)} behave as TF documents; the rest: "
        f"{[r.tensorflow for r in counted if r not in behave]}"
    )
