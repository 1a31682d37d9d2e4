"""``paramserve health ADDRESS``: exit 0 when the server at ADDRESS reports SERVING.

The same probe as ``paramserve-health`` (``paramserve.psserver.health_probe``), which
container health checks use because it starts without torch; this subcommand is there
for scripts that already call ``paramserve``.
"""

from __future__ import annotations

import argparse
import sys

from paramserve.psserver.health_probe import add_arguments, check, probe

__all__ = ["build_parser", "check", "main"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    return add_arguments(parser or argparse.ArgumentParser(prog="paramserve health", description=__doc__))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        return probe(args)
    except ValueError as err:  # an address that is not host:port
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    parsed_parser = build_parser()
    sys.exit(main(parsed_parser.parse_args(), parsed_parser))
