"""The layout keeps the architecture visible: the import rule between packages, every package
installed, package ``__init__`` files that stay light, and no reaching into another module's
private names. ARCHITECTURE.md ("The import rule") states the same table in words."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ("psserver", "coordinator", "worker")

# ---------------------------------------------------------------- where a module belongs

COORDINATOR_BASE = {"errors", "nest", "cluster", "cluster_resolver", "remote_value"}
"""The coordinator's vocabulary: modules that import nothing of the coordinator outside this set."""
COORDINATOR_FACADE = {"cluster_coordinator", "contracts"}
COORDINATOR_TOP = {"__init__", "local_cluster", "sidecar_evaluator"}
"""The user's entry points: they may import everything."""

PSSERVER_RULE: dict[str, set[str]] = {
    "protocol": set(),
    "runtime": {"protocol"},
    "dynamic": {"protocol"},
    "store": {"protocol", "dynamic", "runtime"},
    "dataplane": {"protocol", "runtime"},
    "steps": {"protocol", "dynamic", "store", "dataplane", "runtime"},
    "client": {"protocol", "dynamic", "runtime", "dataplane"},
    "checkpoint": {"protocol", "dynamic", "runtime", "store"},
    "replication": {"protocol", "runtime", "store", "dataplane", "client"},
}
"""psserver package -> the psserver packages it may import (its own always)."""
PSSERVER_FOR_WORKER = {"protocol", "dynamic", "runtime", "client"}
PSSERVER_FOR_COORDINATOR = PSSERVER_FOR_WORKER | {"checkpoint", "replication"}

COORDINATOR_RULE: dict[str, set[str]] = {
    "base": set(),
    "dispatch": {"base"},
    "checkpointing": {"base"},
    "status": {"base", "dispatch", "checkpointing"},
    "recovery": {"base", "dispatch", "checkpointing"},
    "facade": {"base", "dispatch", "checkpointing", "status", "recovery"},
    "strategies": {"base", "dispatch", "checkpointing", "status", "recovery", "facade"},
    "metrics": {"base", "dispatch", "checkpointing", "status", "recovery", "facade", "strategies"},
    "training": {"base", "dispatch", "checkpointing", "status", "recovery", "facade", "strategies", "metrics"},
}
"""coordinator package -> the coordinator packages it may import (``metrics``, the user's metric
objects, sits on the strategies: a metric's state lives where its strategy says); ``top``, ``demos`` and
``commands`` (the entry points) may import every one."""


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return "paramserve." + ".".join(parts)


def package_of(module: str) -> tuple[str, str]:
    """(layer, package) of a paramserve module: ("psserver", "store"), ("coordinator", "base"), ..."""
    parts = module.split(".")[1:]
    layer = parts[0]
    rest = parts[1:]
    if layer == "wire":
        return "wire", "wire"
    if layer == "worker":
        return "worker", "worker"
    if layer == "psserver":
        if len(rest) >= 2 or (rest and rest[0] in PSSERVER_RULE):
            return "psserver", rest[0]
        return "psserver", "root"
    if not rest:
        return "coordinator", "top"
    name = rest[0]
    if len(rest) >= 2 or name in COORDINATOR_RULE or name in {"demos", "commands"}:
        return "coordinator", name
    if name in COORDINATOR_BASE:
        return "coordinator", "base"
    if name in COORDINATOR_FACADE:
        return "coordinator", "facade"
    if name == "metrics":
        return "coordinator", "metrics"
    return "coordinator", "top"


def allowed(source: tuple[str, str], target: tuple[str, str]) -> bool:
    if source == target or target[0] == "wire":
        return True
    (s_layer, s_pkg), (t_layer, t_pkg) = source, target
    if t_layer == "psserver":
        if s_layer == "psserver":
            return s_pkg == "root" or t_pkg in PSSERVER_RULE[s_pkg]
        return t_pkg in (PSSERVER_FOR_WORKER if s_layer == "worker" else PSSERVER_FOR_COORDINATOR)
    if t_layer == "worker":
        return s_layer == "coordinator"
    if s_layer != "coordinator":
        return False
    return s_pkg not in COORDINATOR_RULE or t_pkg in COORDINATOR_RULE[s_pkg]


def library_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def imports_of(path: pathlib.Path, known: set[str]) -> list[tuple[int, str]]:
    """Every paramserve module ``path`` imports, at any depth (functions and TYPE_CHECKING too)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paramserve."):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append((node.lineno, submodule if submodule in known else node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("paramserve.")]
    return found


def test_package_classification_examples():
    assert package_of("paramserve.psserver.store.shard_store") == ("psserver", "store")
    assert package_of("paramserve.psserver.server") == ("psserver", "root")
    assert package_of("paramserve.coordinator.errors") == ("coordinator", "base")
    assert package_of("paramserve.coordinator.contracts") == ("coordinator", "facade")
    assert package_of("paramserve.coordinator.strategies.base") == ("coordinator", "strategies")
    assert package_of("paramserve.coordinator") == ("coordinator", "top")
    assert not allowed(("psserver", "protocol"), ("psserver", "store"))
    assert not allowed(("worker", "worker"), ("coordinator", "base"))
    assert not allowed(("coordinator", "dispatch"), ("coordinator", "status"))
    assert allowed(("coordinator", "commands"), ("coordinator", "training"))


def test_every_import_follows_the_rule():
    modules = library_modules()
    known = set(modules)
    broken = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for name, path in modules.items()
        for line, target in imports_of(path, known)
        if not allowed(package_of(name), package_of(target))
    ]
    assert "\n".join(broken) == "", "ARCHITECTURE.md, 'The import rule': declare a protocol in the lower package"


# ---------------------------------------------------------------- installed packages


def package_folders() -> set[str]:
    return {
        str(init.parent.relative_to(ROOT))
        for layer in (*LAYERS, "proto")
        for init in (ROOT / layer).rglob("__init__.py")
        if ".venv" not in init.parts
    } | {"proto/paramserve/wire"}


def test_every_package_folder_is_installed():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {folder: name for name, folder in settings["package-dir"].items()}
    for name in settings["packages"]:  # a package without its own entry lies in its parent's folder
        parent, _, leaf = name.rpartition(".")
        if name not in settings["package-dir"] and parent in settings["package-dir"]:
            mapped[f"{settings['package-dir'][parent]}/{leaf}"] = name
    missing = sorted(folder for folder in package_folders() if mapped.get(folder) not in settings["packages"])
    assert missing == [], "add each to [tool.setuptools] packages and package-dir"
    unknown = sorted(set(settings["packages"]) - set(mapped.values()))
    assert unknown == [], "every installed package names its folder"


def test_the_image_copies_every_top_level_folder_it_installs():
    """deploy/Dockerfile installs non-editable from the packages list: a folder it does not copy
    would pass every test here and fail only in the image."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY\s+(\S+)\s", dockerfile, flags=re.M))
    tops = {folder.split("/")[0] for folder in package_folders()}
    assert tops <= copied
    assert re.search(r"^RUN pip install [^\n]* \. ", dockerfile, flags=re.M), "the image installs the checkout"
    assert "-e ." not in dockerfile, "the image installs a copy, not an editable checkout"


# ---------------------------------------------------------------- light package __init__ files


def _packages() -> list[str]:
    return sorted(module_name(init) for layer in LAYERS for init in (ROOT / layer).rglob("__init__.py"))


def test_importing_any_package_loads_neither_torch_nor_grpc():
    """A package's __init__ names its surface lazily: the health probe and ``--help`` start in
    milliseconds, and a process that needs one module does not pay for its siblings. Each package
    in a fresh interpreter (torch, once loaded, stays loaded)."""
    code = "import sys, {0}; print(sorted(m for m in ('torch', 'grpc', 'numpy') if m in sys.modules))"
    running = {
        package: subprocess.Popen(
            [sys.executable, "-c", code.format(package)], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for package in _packages()
    }
    heavy = {package: process.communicate(timeout=120)[0].strip() for package, process in running.items()}
    assert {package: loaded for package, loaded in heavy.items() if loaded != "[]"} == {}


def test_every_name_a_package_promises_is_its_homes():
    """Each lazily named attribute is the object its home module defines (a function named like
    its module, ``training.loops``, is the function), and each named module is that module."""
    code = textwrap.dedent(
        """
        import importlib, sys, types

        def home(package, path):
            return importlib.import_module(path if path.startswith("paramserve.") else f"{package}.{path}")

        for name in sys.argv[1:]:
            package = importlib.import_module(name)
            homes, modules = getattr(package, "_HOMES", {}), getattr(package, "_MODULES", {})
            for attribute in getattr(package, "__all__", []):
                value = getattr(package, attribute)
                if attribute in modules:
                    assert value is home(name, modules[attribute]), (name, attribute)
                elif attribute in homes:
                    assert value is getattr(home(name, homes[attribute]), attribute), (name, attribute)
                assert attribute in modules or not isinstance(value, types.ModuleType), (name, attribute)
        """
    )
    subprocess.run([sys.executable, "-c", code, *_packages()], check=True, cwd=ROOT, timeout=120)


def test_layout_is_folders_not_prefixes():
    top_level = [p for layer in ("psserver", "coordinator") for p in (ROOT / layer).glob("*.py")]
    assert len(top_level) <= 25
    for init in [*(ROOT / "psserver").rglob("__init__.py"), *(ROOT / "worker").rglob("__init__.py")]:
        assert len(list(init.parent.glob("*.py"))) - 1 <= 15, init.parent
    for init in (ROOT / "coordinator").rglob("__init__.py"):
        if init.parent.name != "strategies":
            assert len(list(init.parent.glob("*.py"))) - 1 <= 15, init.parent


# ---------------------------------------------------------------- private names stay private

LIBRARY_PRIVATES = {
    "torch._foreach_add_": "torch's multi-tensor kernels have no public name; the optimizer's fast path",
    "torch._foreach_copy_": "the same, for the step engine's copies",
    "torch._foreach_add": "the same, for MirroredStrategy's sum of replica gradients",
    "atexit._run_exitfuncs": "a zygote child runs its exit hooks before os._exit (it never returns to the interpreter)",
    "Point._fields": "namedtuple's documented field list (underscored to avoid field clashes)",
    "dist.ProcessGroupGloo._Options": "gloo's timeout option has no public constructor",
    "torch.Tensor._make_wrapper_subclass": "the one constructor of a tensor with a shape and no storage (rows unread)",
    "metric._reductions": "torchmetrics keeps how a state merges only there (pinned <2; tests/unit/test_metrics.py)",
}
"""Underscored names of other libraries that paramserve uses, each with its reason."""


def _own_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def private_reach_ins(path: pathlib.Path, source: str | None = None) -> list[str]:
    """``x._name`` where ``x`` is not self/cls and this module defines no ``_name`` (so the object
    is another module's), and imports of another module's underscored names. Importing a private
    module of one's own package (``from ...strategies import _capture``) is the package's own."""
    tree = ast.parse(path.read_text() if source is None else source)
    own = _own_names(tree)
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            text = f"{ast.unparse(node.value)}.{node.attr}"
            if node.attr not in own and text not in LIBRARY_PRIVATES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {text}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paramserve"):
            for alias in node.names:
                if alias.name.startswith("_") and not (node.module == package and alias.name.startswith("_")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = [
        hit for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py")) for hit in private_reach_ins(path)
    ]
    assert found == [], "make it a documented public member, or declare a Protocol the friend implements"


def test_the_private_name_check_finds_a_reach_in():
    path = ROOT / "worker" / "example.py"  # not written: the check reads the source given
    source = "from paramserve.worker.core import _hidden\n\n\ndef f(other):\n    return other._secret, self._own\n"
    assert private_reach_ins(path, source) == [
        "worker/example.py:1 imports paramserve.worker.core._hidden",
        "worker/example.py:5 other._secret",
    ]
