"""Checkpoint saves SIGKILLed at random moments: the latest checkpoint always loads whole, and
the next save leaves nothing of the interrupted ones behind.

Each saver is a real process (forked from a forkserver that has imported torch already, so
twenty of them take seconds, not minutes) that saves a 4 MB variable over and over, each
save's values equal to its number, and reports each commit on a pipe.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from paramserve.psserver.checkpoint.shard_files import latest_checkpoint, load_rows, read_manifest, save_checkpoint
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef, ShardState
from paramserve.psserver.runtime.atomic_files import TEMPORARY_PREFIX

KILLS = 20
ROWS, COLS = 1024, 1024  # 4 MB: a save takes long enough to be killed in the middle of
VARIABLE = "model.weight"
SGD = OptimizerSpec("SGD", {"lr": 0.1})
DEADLINE = 60.0


def _state(number: int) -> ShardState:
    return ShardState(ShardRef(VARIABLE, 0), (ROWS, COLS), 0, torch.full((ROWS, COLS), float(number)), SGD)


def _save_forever(root: str, first: int, reports: Connection) -> None:
    """Saves checkpoints numbered first, first+1, ... (keeping two) until killed."""
    number = first
    while True:
        save_checkpoint(Path(root), [_state(number)], keep=2, extra={"number": number})
        reports.send(number)
        number += 1


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((TEMPORARY_PREFIX, ".trash-")))


@pytest.fixture(scope="module")
def saver_context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "paramserve.psserver.checkpoint.shard_files"])
    return context


def test_saves_killed_at_random_moments_never_lose_the_latest_checkpoint(tmp_path, saver_context):
    rng = random.Random(7)
    committed = -1
    leftovers_seen = 0
    for _ in range(KILLS):
        receiver, sender = saver_context.Pipe(duplex=False)
        saver = saver_context.Process(target=_save_forever, args=(str(tmp_path), committed + 1, sender))
        saver.start()
        sender.close()
        assert receiver.poll(DEADLINE), "the saver committed nothing"
        committed = receiver.recv()
        # Kill somewhere inside one of the next saves (a save of 4 MB takes milliseconds).
        receiver.poll(rng.uniform(0.0, 0.05))
        saver.kill()
        saver.join(DEADLINE)
        assert saver.exitcode == -signal.SIGKILL
        while True:  # commits reported before the kill
            try:
                committed = receiver.recv()
            except EOFError:
                break
        receiver.close()

        latest = latest_checkpoint(tmp_path)
        assert latest is not None
        number = read_manifest(latest).extra["number"]
        assert number >= committed, f"checkpoint {number} is older than the last reported commit {committed}"
        restored = load_rows(latest, VARIABLE, 0, ROWS, ShardRef(VARIABLE, 0))
        assert torch.equal(restored.value, torch.full((ROWS, COLS), float(number))), "a torn checkpoint"
        committed = number
        leftovers_seen += len(_leftovers(tmp_path))

    save_checkpoint(tmp_path, [_state(committed + 1)], keep=2, extra={"number": committed + 1})
    assert _leftovers(tmp_path) == [], "the next save sweeps what interrupted saves left"
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]) == 2
    assert leftovers_seen > 0, "no kill landed inside a save: the test did not test anything"
