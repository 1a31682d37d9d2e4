"""The ``paramserve`` command: one entry point, a subcommand per role."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple

Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


class Subcommand(NamedTuple):
    """A module that offers ``build_parser(parser)`` and a runner ``(args, parser) -> int``."""

    name: str
    module: str
    runner: str
    help: str


SUBCOMMANDS = (
    Subcommand("ps", "paramserve.psserver.__main__", "run", "run a parameter server"),
    Subcommand("worker", "paramserve.worker.__main__", "run", "run a worker"),
    Subcommand("demo", "paramserve.coordinator.commands.demo", "main", "train an MLP on a local cluster it starts (the quick start)"),
    Subcommand("launch", "paramserve.coordinator.commands.launch", "main", "run a training script against a local cluster"),
    Subcommand("health", "paramserve.coordinator.commands.health", "main", "check that a server is SERVING (exit status 0)"),
    Subcommand("evaluator", "paramserve.coordinator.commands.evaluate", "main",
               "evaluate each new checkpoint and write TensorBoard summaries (a sidecar evaluator)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramserve",
        description="Parameter-server training for PyTorch: run a role of a cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        module = importlib.import_module(command.module)
        subparser = sub.add_parser(command.name, help=command.help, description=module.__doc__)
        module.build_parser(subparser)
        subparser.set_defaults(runner=getattr(module, command.runner), subparser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runner: Runner = args.runner
    return runner(args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
