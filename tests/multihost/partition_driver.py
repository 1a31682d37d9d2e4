"""The coordinator's program of tests/multihost/test_replica_partition.py, run on its own host.

    python partition_driver.py CONTROL_DIR PS_A PS_B WORKER TOKEN_FILE

Trains the demo's MLP on one shard group (PS_A primary, PS_B its backup) and one worker, and
talks to the test through files in CONTROL_DIR: it writes ``phase1.json`` once training runs,
trains on (the test cuts PS_A off from this host meanwhile) until its backup took over, then
AFTER closures more, and writes ``phase2.json``; then waits for ``healed`` and writes
``final.json`` once PS_A rejoined: each member's shards, and whether they are equal.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import torch
from network_hosts import wait_for

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.demos.digits import MLP, train_step, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.psserver.client.calls import CallOptions, Stub
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.runtime.channels import channel_options, open_channel
from paramserve.psserver.runtime.security import read_token_file

BEFORE, CHUNK, AFTER = 60, 30, 60


def shards(address: str, token: str) -> dict[str, dict[str, object]]:
    stub = Stub(open_channel(address, None, channel_options(64 << 20)))
    return {
        f"{s.ref.variable}/{s.ref.shard}": {
            "version": s.version,
            "keys": list(s.applied_keys),
            "value": s.value.flatten().tolist(),
            "slots": {name: slot.flatten().tolist() for name, slot in s.slots.items()},
        }
        for s in stub.export(1 << 20, CallOptions(token, 30, 30))
    }


def main(control: pathlib.Path, ps_a: str, ps_b: str, worker: str, token_file: str) -> int:
    token = read_token_file(pathlib.Path(token_file))
    strategy = ParameterServerStrategy(
        ClusterSpec(parameter_servers=(ps_a, ps_b), workers=(worker,)),
        variable_partitioner=FixedShardsPartitioner(1),
        token=token,
        ps_replicas=2,
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(32)
    optimizer = strategy.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        for _ in range(BEFORE):
            coordinator.schedule(train_step, args=(batches, model, optimizer))
        coordinator.join(timeout=120)
        (control / "phase1.json").write_text(json.dumps({"primary": strategy.client.addresses[0]}))
        steps, deadline = BEFORE, time.monotonic() + 120
        while strategy.client.addresses[0] == ps_a:  # training goes on until the probes lose PS_A
            if time.monotonic() > deadline:
                raise TimeoutError("the coordinator never lost the primary it was cut off from")
            values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(CHUNK)]
            coordinator.join(timeout=240)  # every closure completes, across the failover
            steps += CHUNK
        values = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(AFTER)]
        coordinator.join(timeout=240)
        steps += AFTER
        assert all(torch.isfinite(v.fetch()) for v in values)
        recoveries = [(r.server, r.result) for r in coordinator.recovery.recoveries] if coordinator.recovery else []
        phase2 = {"primary": strategy.client.addresses[0], "recoveries": recoveries, "steps": steps}
        (control / "phase2.json").write_text(json.dumps(phase2))
        wait_for((control / "healed").exists, "the test heals the partition", 240)
        groups = strategy.servers.groups
        assert groups is not None
        wait_for(lambda: len(groups.states()[0].in_sync) == 1, "the cut-off server rejoins", 120)
        members = {address: shards(address, token) for address in (ps_a, ps_b)}
    strategy.close()
    (control / "final.json").write_text(json.dumps({"members": members, "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1]), *sys.argv[2:6]))
