"""``paramserve launch``: run your own training script against a local cluster.

Starts parameter servers and workers on 127.0.0.1, runs the command with
PARAMSERVE_PS, PARAMSERVE_WORKERS and PARAMSERVE_TOKEN set (so that
``ClusterSpec.from_env()`` and ``ParameterServerStrategy()`` find them), and
stops the cluster when the command ends. A server or worker that dies meanwhile
is restarted on its port (the coordinator then restores a parameter server from
its latest checkpoint, or, with ``--ps-replicas 2``, a backup takes over and the
restarted server rejoins as a backup). Exits with the command's status.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess

from paramserve.coordinator.recovery.replica_groups import REPLICAS_ENV
from paramserve.psserver.runtime.cpus import PROCESSES_ENV, torch_threads


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve launch", description=__doc__)
    parser.add_argument("--ps", type=int, default=2, help="parameter servers (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="workers (default: %(default)s)")
    parser.add_argument(
        "--ps-replicas",
        type=int,
        default=1,
        help="servers per shard group: --ps servers form --ps/--ps-replicas groups of a primary and backups "
        "(sets PARAMSERVE_PS_REPLICAS; default: %(default)s)",
    )
    parser.add_argument("--no-token", action="store_true", help="run the cluster without a shared token")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    return parser


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from paramserve.coordinator.local_cluster import LocalCluster

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. paramserve launch -- python train.py")
    if args.ps < 1 or args.workers < 1:
        parser.error("--ps and --workers must be at least 1")
    if args.ps_replicas < 1 or args.ps % args.ps_replicas:
        parser.error(f"--ps-replicas must be at least 1 and divide --ps ({args.ps}), got {args.ps_replicas}")
    token = None if args.no_token else secrets.token_hex(16)
    with LocalCluster(num_ps=args.ps, num_workers=args.workers, token=token, supervise=True) as cluster:
        env = {
            **os.environ,
            "PARAMSERVE_PS": ",".join(cluster.spec.parameter_servers),
            "PARAMSERVE_WORKERS": ",".join(cluster.spec.workers),
        }
        if token:
            env["PARAMSERVE_TOKEN"] = token
        if args.ps_replicas > 1:
            env[REPLICAS_ENV] = str(args.ps_replicas)
        # The command shares the machine with the cluster: its torch threads are sized alike.
        env.setdefault(PROCESSES_ENV, str(args.ps + args.workers + 1))
        env.setdefault("OMP_NUM_THREADS", str(torch_threads(None, env)))
        return subprocess.call(command, env=env)
