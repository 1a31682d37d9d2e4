"""The four TensorFlow tutorials, translated (examples/), run as a user runs them (issue 11)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.timeout(300)


def run(*command: str, cwd: pathlib.Path) -> str:
    done = subprocess.run(
        list(command),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=280,
        env={k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "RANK", "WORLD_SIZE")},
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_fit_with_mirrored_strategy(tmp_path):
    out = run(
        sys.executable,
        str(EXAMPLES / "fit_with_mirrored_strategy.py"),
        "--epochs",
        "3",
        "--workdir",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert "Number of devices: 2" in out
    assert "Learning rate for epoch 1 is 0.001" in out
    assert sorted(p.name for p in (tmp_path / "training_checkpoints").glob("*.pt")) == [
        "ckpt_1.pt",
        "ckpt_2.pt",
        "ckpt_3.pt",
    ]
    assert (tmp_path / "logs" / "train").is_dir() and (tmp_path / "saved_model.pt").exists()
    accuracies = [float(line.rsplit(" ", 1)[-1]) for line in out.splitlines() if line.startswith("Eval loss")]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] > 0.85, "the exported model evaluates the same"


def test_custom_training_loop(tmp_path):
    out = run(sys.executable, str(EXAMPLES / "custom_training_loop.py"), "--epochs", "3", cwd=tmp_path)
    assert "Epoch 3, Loss:" in out
    assert float(out.strip().splitlines()[-1].rsplit(" ", 1)[-1]) > 0.8


def ps_results(out: str) -> dict:
    results = json.loads(out.strip().splitlines()[-1])
    assert results["fit_accuracy"] > 0.5 and results["loop_accuracy"] > 0.5
    assert results["sidecar_accuracy"] == pytest.approx(results["inline_accuracy"]) and results["inline_accuracy"] > 0.6
    return results


def test_parameter_server_training_with_tf_config(tmp_path):
    ps_results(
        run(
            sys.executable,
            str(EXAMPLES / "parameter_server_training.py"),
            "--tf-config",
            "--epochs",
            "2",
            "--json",
            "--workdir",
            str(tmp_path),
            cwd=tmp_path,
        )
    )
    assert (tmp_path / "keras_model" / "ckpt" / "ckpt-2").is_dir()


def test_parameter_server_training_under_paramserve_launch(tmp_path):
    """The README's way: the cluster and its token come from paramserve launch's environment."""
    ps_results(
        run(
            sys.executable,
            "-m",
            "paramserve.coordinator.commands.cli",
            "launch",
            "--ps",
            "1",
            "--workers",
            "2",
            "--",
            sys.executable,
            str(EXAMPLES / "parameter_server_training.py"),
            "--cluster-from-env",
            "--epochs",
            "2",
            "--json",
            "--workdir",
            str(tmp_path),
            cwd=tmp_path,
        )
    )


def test_multi_worker_training_survives_a_killed_worker(tmp_path):
    out = run(
        sys.executable,
        str(EXAMPLES / "multi_worker_with_fit.py"),
        "--epochs",
        "3",
        "--kill-at-epoch",
        "1",
        "--workdir",
        str(tmp_path),
        cwd=tmp_path,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["attempts"] == 2, "worker 1 was killed once, then every worker restarted"
    assert result["epochs_run"] == [1, 2], "the restarted workers resumed from the backup of epoch 1"
    assert result["accuracy"] > 0.85
    assert "killed at the start of epoch 1" in (tmp_path / "worker-1-attempt-0.log").read_text()
    assert not (tmp_path / "backup").exists(), "a completed fit deletes its backup"


def test_recommendation_example_learns(tmp_path):
    out = run(sys.executable, str(EXAMPLES / "recommendation.py"), "--steps", "300", "--rows", "2000", cwd=tmp_path)
    scores = json.loads(out.strip().splitlines()[-1])
    assert scores["auc_after"] > max(0.65, scores["auc_before"] + 0.1), scores
    assert "samples/s" in out
