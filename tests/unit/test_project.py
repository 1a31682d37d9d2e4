"""Promises about the project itself: generated code is fresh, dependencies point one way,
the client loads none of the server's modules, and the servicer implements exactly the
service the .proto declares."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "proto"))
import generate  # noqa: E402  (proto/generate.py, importable once proto/ is on the path)

LAYERS = {"psserver": 0, "worker": 1, "coordinator": 2}


def test_committed_generated_code_matches_the_proto_sources(tmp_path):
    fresh = generate.generate_into(tmp_path)
    assert fresh, "protoc produced nothing"
    stale = [
        str(path.relative_to(tmp_path))
        for path in fresh
        if (generate.PROTO_ROOT / path.relative_to(tmp_path)).read_bytes() != path.read_bytes()
    ]
    assert not stale, f"generated code is stale, run `python proto/generate.py`: {stale}"


def _imported_layers(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "paramserve" and parts[1] in LAYERS:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_dependencies_point_from_coordinator_to_worker_to_psserver(layer):
    offenders = []
    for path in (ROOT / layer).rglob("*.py"):
        for imported in _imported_layers(path):
            if LAYERS[imported] > LAYERS[layer]:
                offenders.append(f"{path.relative_to(ROOT)} imports paramserve.{imported}")
    assert not offenders, "psserver <- worker <- coordinator is violated: " + "; ".join(offenders)


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return modules | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


CORES = [
    "psserver/store/shard_store.py",
    "psserver/store/shards.py",
    "psserver/store/optimizer.py",
    "psserver/protocol/partition.py",
    "psserver/store/idempotency.py",
    "psserver/checkpoint/shard_files.py",
    "psserver/protocol/errors.py",
    "psserver/protocol/tensors.py",
    "psserver/protocol/types.py",
    "psserver/runtime/atomic_files.py",
    "psserver/protocol/initializers.py",
    "worker/core.py",
    "worker/closure_access.py",
    "worker/results.py",
    "worker/closure_pickling.py",
    "worker/layers.py",
    "worker/resources.py",
]


@pytest.mark.parametrize("core", CORES)
def test_cores_import_no_grpc_and_no_wire_messages(core):
    modules = _imported_modules(ROOT / core)
    assert not any(m.split(".")[0] in {"grpc", "grpc_health"} for m in modules), f"{core} imports grpc"
    assert not any(m.startswith("paramserve.wire") for m in modules), f"{core} imports wire messages"


# What a step means and the data plane that carries it speak wire messages (they are not cores),
# but no grpc: the step engine serves the Step RPC and the data plane alike.
TRANSPORT_NEUTRAL = [
    "psserver/steps/engine.py",
    "psserver/steps/programs.py",
    "psserver/protocol/metadata.py",
    "psserver/dataplane/frames.py",
    "psserver/dataplane/dataplane_server.py",
    "psserver/dataplane/dataplane_client.py",
    "psserver/client/step_work.py",
]


@pytest.mark.parametrize("module", TRANSPORT_NEUTRAL)
def test_the_step_engine_and_the_data_plane_import_no_grpc(module):
    modules = _imported_modules(ROOT / module)
    assert not any(m.split(".")[0] in {"grpc", "grpc_health"} for m in modules), f"{module} imports grpc"


@pytest.mark.parametrize("module", ["psserver/dataplane/frames.py", "psserver/dataplane/dataplane_server.py"])
def test_the_data_plane_server_carries_steps_without_knowing_what_they_mean(module):
    application = {f"paramserve.psserver.{name}" for name in ("steps", "programs", "store", "servicer")}
    assert _imported_modules(ROOT / module) & application == set()


# The parameter server's own modules: a worker or a coordinator that imports the client loads none.
SERVER_MODULES = [
    "store",
    "shards",
    "servicer",
    "steps",
    "programs",
    "checkpoint",
    "idempotency",
    "serving",
    "error_boundary",
    "command_line",
    "server",
    "metrics_http",
    "cpus",
    "dataplane_server",
    "dynamic_table",
]


def test_importing_the_client_loads_none_of_the_servers_modules():
    code = "import sys, paramserve.psserver.client.ps_client; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    server_side = {f"paramserve.psserver.{name}" for name in SERVER_MODULES}
    assert "paramserve.psserver.client.ps_client" in loaded.stdout.split()
    assert server_side & set(loaded.stdout.split()) == set()


def test_the_demos_package_names_what_it_shares_and_imports_it_when_first_used():
    """The digits classifier lives in coordinator/demos/digits.py (the ``demo`` command only runs
    it); the package's import adds none of its modules to what ``paramserve.coordinator`` loads."""
    code = "import sys, paramserve.coordinator.demos; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert "paramserve.coordinator.demos" in loaded.stdout.split()
    assert not [m for m in loaded.stdout.split() if m.startswith("paramserve.coordinator.demos.")]
    import paramserve.coordinator.demos as demos
    from paramserve.coordinator.demos.digits import MLP, worker_batches

    assert sorted(demos.__all__) == sorted(demos._HOMES)
    assert (demos.MLP, demos.worker_batches) == (MLP, worker_batches)


# Every service has its core, servicer, server factory, errors and __main__: those names recur by design.
PER_PACKAGE_NAMES = {"__init__.py", "__main__.py", "server.py", "servicer.py", "errors.py"}


def test_no_two_modules_share_a_name():
    seen: dict[str, list[str]] = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            if path.name not in PER_PACKAGE_NAMES:
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


MAX_MODULE_LINES = 800
"""A module past this has grown two concepts; split it where they part (generated code aside)."""


def test_no_library_module_outgrows_one_concept():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for layer in LAYERS
        for path in (ROOT / layer).rglob("*.py")
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
    }
    assert {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}
    assert sizes["psserver/client/ps_client.py"] < 600, (
        "the client keeps layouts and the control plane; steps travel elsewhere"
    )


# Classes whose type says which strategy is in use: training code asks the strategy instead.
STRATEGY_TYPES = ("Strategy", "ServerOptimizer", "ShardedEmbedding", "ServerMetricState")


def test_training_asks_the_strategy_and_never_checks_its_type():
    offenders = []
    for path in (ROOT / "coordinator" / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in {"isinstance", "type"}:
                named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if any(name.endswith(STRATEGY_TYPES) for name in named):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "ask the strategy (a method of the Strategy API) instead: " + ", ".join(offenders)


def test_the_coordinator_declares_what_it_needs_of_a_strategy_instead_of_probing():
    """The coordinator <-> strategy <-> recovery seam is coordinator/contracts.py's Protocols."""
    for module in ("cluster_coordinator.py", "recovery/ps_recovery.py", "checkpointing/checkpoint_manager.py"):
        text = (ROOT / "coordinator" / module).read_text()
        tree = ast.parse(text)
        probes = [
            f"{module}:{n.lineno}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") in {"hasattr", "getattr"}
        ]
        assert probes == [], f"declare it in coordinator/contracts.py instead: {probes}"
        assert "type: ignore" not in text, f"{module} silences the type checker on the seam"
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        local_imports = [
            f"{module}:{n.lineno}"
            for f in functions
            for n in ast.walk(f)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("paramserve.coordinator")
        ]
        assert local_imports == [], f"a function-level import hides an import cycle: {local_imports}"


def test_checkpointing_declares_what_it_needs_of_a_strategy_and_imports_none():
    """Checkpointing sits below the strategies: CheckpointedVariables is its side of the seam."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / "coordinator" / "checkpointing").rglob("*.py")
        for module in _imported_modules(path)
        if module.startswith("paramserve.coordinator.strategies")
    ]
    assert offenders == []


def test_servicer_implements_every_rpc_of_the_proto():
    from paramserve.psserver import servicer
    from paramserve.wire.v1 import parameter_server_pb2

    declared = {m.name for m in parameter_server_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods}
    implemented = {name for name in declared if callable(getattr(servicer.ParameterServerServicer, name, None))}
    assert implemented == declared
