"""Every process-wide hook and patch a strategy installs has an owner that removes it: after
``close()`` of every strategy, torch's global hooks, ``Optimizer.__init__``, the classes of
the modules and optimizers built in scope are as they were, and no thread is left.

The check runs in a fresh interpreter: strategies of other tests (closed or garbage-collected
at unpredictable times) cannot disturb its before/after comparison there."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from paramserve.coordinator.strategies._process_hooks import SharedHook

SCRIPT = textwrap.dedent(
    """
    import json, threading
    import torch
    from torch import nn
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    from paramserve.coordinator import (
        CentralStorageStrategy, ClusterSpec, MirroredStrategy, MultiWorkerMirroredStrategy,
        OneDeviceStrategy, ParameterServerStrategy,
    )
    from paramserve.coordinator.strategies.multi_worker_cluster import Rendezvous

    def snapshot():
        hooks = {
            f"{mod.__name__}.{name}": len(value)
            for mod in (module_hooks, optimizer_hooks)
            for name, value in vars(mod).items()
            if name.startswith("_global") and isinstance(value, dict)
        }
        return {"hooks": hooks, "optimizer_init": id(torch.optim.Optimizer.__init__),
                "threads": sorted(t.name for t in threading.enumerate())}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)
        def forward(self, x):
            return self.layer(x)

    def step(model, optimizer):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

    before = snapshot()
    report = {"during": {}, "classes": {}, "module_hooks": {}}
    factories = {
        "one_device": lambda: OneDeviceStrategy("cpu"),
        "mirrored": lambda: MirroredStrategy(["cpu:0", "cpu:1"]),
        "central_storage": lambda: CentralStorageStrategy(["cpu:0", "cpu:1"]),
        "multi_worker": lambda: MultiWorkerMirroredStrategy(cluster_resolver=Rendezvous(0, 1)),
        "parameter_server": lambda: ParameterServerStrategy(ClusterSpec(("127.0.0.1:9",), ("127.0.0.1:10",))),
    }
    for name, make in factories.items():
        strategy = make()
        with strategy.scope():
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            report["during"][name + " (scope open)"] = snapshot()["optimizer_init"] != before["optimizer_init"]
        if name != "parameter_server":  # a parameter-server step needs servers; its hooks exist without one
            strategy.run(step, args=(model, optimizer))
        swapped = type(model) is not Net or type(optimizer) is not torch.optim.SGD
        report["during"][name] = snapshot() != before or swapped
        strategy.close()
        strategy.close()  # idempotent
        report["classes"][name] = [type(model) is Net, type(optimizer) is torch.optim.SGD,
                                   "_paramserve_link" not in vars(model), "_paramserve_link" not in vars(optimizer)]
        report["module_hooks"][name] = len(model._forward_pre_hooks)
    report["before"], report["after"] = before, snapshot()
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report() -> dict:
    completed = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_strategies_do_patch_while_open(report):
    # The comparison below is only meaningful if the strategies really patched something.
    assert report["during"] == {
        "one_device (scope open)": False,
        "one_device": False,  # nothing process-wide at all
        "mirrored (scope open)": True,
        "mirrored": True,  # Optimizer.__init__; guards and class swaps
        "central_storage (scope open)": True,
        "central_storage": True,
        "multi_worker (scope open)": False,
        "multi_worker": True,  # its optimizer step pre-hook
        "parameter_server (scope open)": True,
        "parameter_server": True,  # Optimizer.__init__; optimizer class
    }


def test_after_close_torch_and_the_process_are_as_before(report):
    assert report["after"] == report["before"]


def test_after_close_models_and_optimizers_are_plain_torch_objects(report):
    assert report["classes"] == {name: [True] * 4 for name in report["classes"]}
    assert report["module_hooks"] == {name: 0 for name in report["module_hooks"]}


def test_a_shared_hook_is_installed_once_and_removed_with_its_last_lease():
    events: list[str] = []

    def install():
        events.append("install")
        return lambda: events.append("remove")

    hook = SharedHook("test", install)
    first, second = hook.acquire(), hook.acquire()
    assert events == ["install"] and hook.installed
    first.release()
    first.release()  # idempotent
    assert events == ["install"]
    second.drop()  # a garbage-collected holder: marked only, removed at the next acquire/release
    assert hook.installed
    hook.acquire().release()  # forgets the dropped lease (remove), then holds and releases its own
    assert events == ["install", "remove", "install", "remove"]
    assert not hook.installed
