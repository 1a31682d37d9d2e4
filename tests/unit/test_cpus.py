"""The rule that sizes every server's and worker's torch threads (psserver/runtime/cpus.py)."""

from __future__ import annotations

import os

import pytest
import torch

from paramserve.psserver.runtime import cpus
from paramserve.psserver.runtime.cpus import usable_cpus


@pytest.mark.parametrize(
    ("usable", "environ", "expected"),
    [
        (2, {}, 2),  # alone on a 2-core machine (or container)
        (64, {}, 64),  # alone on 64 cores
        (2, {cpus.PROCESSES_ENV: "5"}, 1),  # a local cluster of 5 processes on 2 cores: never 0
        (16, {cpus.PROCESSES_ENV: "5"}, 3),  # ... on 16 cores
        (64, {cpus.PROCESSES_ENV: "5"}, 12),  # ... on 64 cores
        (16, {cpus.PROCESSES_ENV: "5", cpus.OMP_ENV: "1"}, 1),  # the variable torch reads, where set
        (2, {cpus.OMP_ENV: "4"}, 4),
    ],
)
def test_threads_are_the_processes_share_of_the_usable_cpus(usable, environ, expected):
    assert cpus.torch_threads(None, environ, cpus=usable) == expected


def test_an_explicit_count_wins_and_nonsense_is_refused():
    assert cpus.torch_threads(3, {cpus.PROCESSES_ENV: "100"}, cpus=2) == 3
    with pytest.raises(ValueError, match=">= 1"):
        cpus.torch_threads(0, {})
    with pytest.raises(ValueError, match=cpus.PROCESSES_ENV):
        cpus.torch_threads(None, {cpus.PROCESSES_ENV: "lots"}, cpus=2)
    assert cpus.torch_threads(3, {cpus.OMP_ENV: "1"}, cpus=2) == 3
    with pytest.raises(ValueError, match=cpus.OMP_ENV):
        cpus.torch_threads(None, {cpus.OMP_ENV: "0"}, cpus=2)


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", None),  # no quota
        ("150000 100000\n", 1),  # a 1.5-CPU container limit: 1 whole CPU
        ("400000 100000\n", 4),
        ("garbage", None),
    ],
)
def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path, cpu_max, expected):
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert cpus.usable_cpus(path) == (affinity if expected is None else min(affinity, expected))
    assert cpus.usable_cpus(tmp_path / "absent") == affinity


@pytest.mark.skipif(usable_cpus() < 2, reason="needs 2 CPUs: with one, the share is torch's default")
def test_a_program_driving_a_local_cluster_takes_its_share_of_threads_and_gives_it_back(monkeypatch):
    from paramserve.coordinator.local_cluster import _SharedThreads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    default = usable_cpus()
    torch.set_num_threads(default)
    try:
        taken = _SharedThreads.take(processes=2 * default)  # more processes than CPUs: one thread each
        assert taken is not None and torch.get_num_threads() == 1
        taken.give_back()
        assert torch.get_num_threads() == default

        chosen = _SharedThreads.take(processes=2 * default)
        assert chosen is not None
        torch.set_num_threads(2)  # the program chose meanwhile: its choice stays
        chosen.give_back()
        assert torch.get_num_threads() == 2

        torch.set_num_threads(default)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert _SharedThreads.take(processes=2 * default) is None, "a program that chose keeps its threads"
        assert torch.get_num_threads() == default
    finally:
        torch.set_num_threads(default)
