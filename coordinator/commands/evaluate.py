"""``paramserve evaluator``: evaluate each new checkpoint as training writes it (TensorFlow's evaluator task).

Watches --checkpoint-dir, loads every new checkpoint (ModelCheckpoint files, or
parameter-server checkpoints: no server is needed) into a model built by --model,
evaluates it on the batches --data returns and writes TensorBoard summaries to
--log-dir/validation. Without --model and --data it evaluates the demo's MLP on the
digits test split, so ``paramserve demo --checkpoint-dir D`` and
``paramserve evaluator --checkpoint-dir D`` work together. Stops on SIGTERM or Ctrl-C,
or after --max-evaluations.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import pathlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch

from paramserve.psserver.runtime.command_line import LOG_LEVELS


def digits_test_batches(batch_size: int = 128) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The demo's evaluation data: the digits test split."""
    from paramserve.coordinator.demos.digits import digits_split

    _, _, x_test, y_test = digits_split()
    return iter([(x_test[i : i + batch_size], y_test[i : i + batch_size]) for i in range(0, len(x_test), batch_size)])


def load_callable(spec: str, flag: str, parser: argparse.ArgumentParser) -> Any:
    """``package.module:name`` -> that object (exits with the fix when it is not there)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        parser.error(f"{flag} {spec!r}: write it as package.module:function")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        parser.error(f"{flag} {spec!r}: {err}")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="paramserve evaluator", description=__doc__)
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, required=True, help="where training writes checkpoints")
    parser.add_argument(
        "--every", type=float, default=10.0, help="seconds between looks for a new checkpoint (default: %(default)s)"
    )
    parser.add_argument(
        "--log-dir", type=pathlib.Path, help="write TensorBoard summaries to LOG_DIR/validation (default: none)"
    )
    parser.add_argument(
        "--model",
        default="paramserve.coordinator.demos.digits:MLP",
        help="package.module:function returning the model to load checkpoints into (default: %(default)s)",
    )
    parser.add_argument(
        "--data",
        default="paramserve.coordinator.commands.evaluate:digits_test_batches",
        help="package.module:function returning (inputs, targets) batches (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, help="batches per evaluation (default: all)")
    parser.add_argument(
        "--max-evaluations", type=int, help="stop after this many evaluations (default: run until stopped)"
    )
    parser.add_argument("--json", action="store_true", help="print each evaluation as a JSON line")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=LOG_LEVELS,
        help=f"how much to log: {', '.join(LOG_LEVELS)} (default: %(default)s)",
    )
    return parser


class _Reiterable:
    """The batches of ``make()``, anew for every evaluation."""

    def __init__(self, make: Any):
        self._make = make

    def __iter__(self) -> Iterator[Any]:
        return iter(self._make())


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from paramserve.coordinator.sidecar_evaluator import SidecarEvaluator

    logging.basicConfig(level=args.log_level, format="%(asctime)s evaluator %(levelname)s %(name)s: %(message)s")
    if args.every <= 0:
        parser.error("--every must be a positive number of seconds")
    model = load_callable(args.model, "--model", parser)()
    data = _Reiterable(load_callable(args.data, "--data", parser))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def report(evaluation: Any) -> None:
        line = {"checkpoint": str(evaluation.checkpoint), "step": evaluation.step, **evaluation.results}
        print(json.dumps(line) if args.json else " ".join(f"{k}={v}" for k, v in line.items()), flush=True)

    evaluator = SidecarEvaluator(
        model,
        data,
        args.checkpoint_dir,
        log_dir=args.log_dir,
        steps=args.steps,
        max_evaluations=args.max_evaluations,
        every=args.every,
        on_evaluation=report,
    )
    evaluator.run(stop)
    return 0
