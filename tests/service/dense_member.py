"""One member of a dense group, for tests/service/test_dense_group.py (run as a script).

    python dense_member.py '<json plan>'

The plan: ``store`` (host:port of the test's rendezvous store), ``secret`` (its session secret,
hex), ``token`` (the cluster's), ``initial`` (name -> list of floats),
``lr`` (SGD), ``rounds``: each ``{"generation", "rank", "world", "steps": [[key, gradient], ...],
"die_after": n}`` (``die_after``: the process exits abruptly after n steps). Prints one JSON
line: each round's outcome (``ok`` or the error's type and message), the final values and the
version.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time

import cloudpickle
import torch

from paramserve.worker.closure_access import LocalVariables
from paramserve.worker.dense.group import DenseReplicas, DenseRound, GroupSpec
from paramserve.worker.results import GroupFailed


def main(plan: dict) -> None:
    torch.set_num_threads(1)
    variables = LocalVariables()
    replicas = DenseReplicas(variables, plan["token"])
    initial = {name: torch.tensor(values) for name, values in plan["initial"].items()}
    buffer = io.BytesIO()
    torch.save({"version": 0, "values": initial, "optimizer": None, "applied": []}, buffer)
    optimizer = cloudpickle.dumps((torch.optim.SGD, [(tuple(sorted(initial)), {"lr": plan["lr"]})]))
    outcomes = []
    for round_ in plan["rounds"]:
        secret = bytes.fromhex(plan["secret"])
        spec = GroupSpec(
            round_["generation"], round_["rank"], round_["world"], plan["store"], "127.0.0.1", 20.0, secret
        )
        dense = DenseRound(spec, tuple(sorted(initial)), optimizer, 0, buffer.getvalue())
        started = time.monotonic()
        try:
            replicas.begin_round(dense)
            for done, (key, gradient) in enumerate(round_["steps"]):
                if round_.get("die_after") == done:
                    replicas.settle()  # its steps so far are applied everywhere
                    os._exit(3)
                replicas.exchange({name: torch.full_like(value, gradient) for name, value in initial.items()}, key)
            replicas.finish_round()
            outcomes.append({"ok": True})
        except GroupFailed as exc:
            outcomes.append({"ok": False, "error": str(exc), "seconds": time.monotonic() - started})
    values = {name: variables.parameters[name].detach().tolist() for name in initial}
    print(json.dumps({"outcomes": outcomes, "values": values, "version": replicas.version}), flush=True)
    replicas.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
