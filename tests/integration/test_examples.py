"""The README's one-script-every-strategy example keeps working (in-process strategies here;
the parameter-server and multi-worker paths are covered by test_fit.py)."""

from __future__ import annotations

import pytest

from paramserve.coordinator.demos import examples


@pytest.mark.parametrize("strategy", ["default", "one_device", "mirrored", "central_storage"])
def test_the_example_trains_under_each_in_process_strategy(strategy, capsys):
    assert examples.main(["--strategy", strategy, "--epochs", "2", "--steps-per-epoch", "40"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"{strategy}: test accuracy ")
    assert float(line.rsplit(" ", 1)[-1]) > 0.85


def test_an_unknown_strategy_is_named():
    with pytest.raises(ValueError, match="unknown strategy 'tpu'"):
        examples.make_strategy("tpu")
