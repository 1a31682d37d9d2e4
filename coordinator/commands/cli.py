"""The ``paramserve`` command: one entry point, a subcommand per role.

A configuration the command cannot start with (a bad flag, an unreadable token file,
a malformed TF_CONFIG, a busy port) ends with one line naming the problem and the fix,
and exit status 2; ``--debug`` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from importlib import metadata
from typing import NamedTuple, NoReturn

from paramserve.psserver.runtime.command_line import run_reporting_errors

Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
USAGE_ERROR = 2
"""Exit status of a bad flag or configuration (argparse's own)."""


class Subcommand(NamedTuple):
    """A module that offers ``build_parser(parser)`` and a runner ``(args, parser) -> int``."""

    name: str
    module: str
    runner: str
    help: str


SUBCOMMANDS = (
    Subcommand("ps", "paramserve.psserver.__main__", "run", "run a parameter server"),
    Subcommand("worker", "paramserve.worker.__main__", "run", "run a worker"),
    Subcommand(
        "demo",
        "paramserve.coordinator.commands.demo",
        "main",
        "train an MLP on a local cluster it starts (the quick start)",
    ),
    Subcommand(
        "launch", "paramserve.coordinator.commands.launch", "main", "run a training script against a local cluster"
    ),
    Subcommand(
        "health", "paramserve.coordinator.commands.health", "main", "check that a server is SERVING (exit status 0)"
    ),
    Subcommand(
        "status",
        "paramserve.coordinator.commands.status",
        "main",
        "print what a coordinator's status page shows (workers, servers, training, events)",
    ),
    Subcommand(
        "evaluator",
        "paramserve.coordinator.commands.evaluate",
        "main",
        "evaluate each new checkpoint and write TensorBoard summaries (a sidecar evaluator)",
    ),
)


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one line (``paramserve ps: error: ... (see --help)``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    try:
        return metadata.version("paramserve")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree without an install
        return "unknown"


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is one), or None (``--help``, a typo)."""
    names = {command.name for command in SUBCOMMANDS}
    return next((word for word in argv if word in names), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given ``argv`` that names a subcommand, only that subcommand's module
    is imported: each process starts without the other commands' imports (about a second of
    CPU at every start of a server on a small machine)."""
    chosen = chosen_command(argv) if argv is not None else None
    parser = OneLineParser(
        prog="paramserve",
        description="Parameter-server training for PyTorch: run a role of a cluster.",
    )
    parser.add_argument("--version", action="version", version=f"paramserve {version()}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a failed start, not only its message"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        if chosen is not None and command.name != chosen:
            sub.add_parser(command.name, help=command.help)  # listed, never parsed
            continue
        module = importlib.import_module(command.module)
        subparser = sub.add_parser(command.name, help=command.help, description=module.__doc__)
        module.build_parser(subparser)
        subparser.set_defaults(runner=getattr(module, command.runner), subparser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    runner: Runner = args.runner
    return run_reporting_errors(runner, args, args.subparser)


if __name__ == "__main__":
    sys.exit(main())
