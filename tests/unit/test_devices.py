"""Where a process computes (psserver/runtime/devices.py): device names, and the rule that gives a
worker its device from --device and the environment. Pure: the CUDA device count is passed in."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.runtime.devices import computing_on, resolve_device, unused_gpus_warning, worker_device

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("environ", "gpus", "expected"),
    [
        ({}, 0, CPU),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}, 0, CPU),  # launcher variables mean nothing without CUDA
        ({}, 2, CPU),  # a worker nobody placed takes no GPU
        ({"LOCAL_RANK": "1"}, 2, torch.device("cuda", 1)),
        ({"LOCAL_RANK": "3"}, 2, torch.device("cuda", 1)),  # more workers than GPUs: they share
        ({"CUDA_VISIBLE_DEVICES": "5"}, 1, torch.device("cuda", 0)),  # the first (only) visible GPU
        ({"CUDA_VISIBLE_DEVICES": " "}, 1, CPU),
    ],
)
def test_a_workers_default_device_comes_from_the_launchers_variables_where_cuda_is(environ, gpus, expected):
    assert worker_device(None, environ, cuda_devices=gpus) == expected


def test_the_device_flag_wins_and_is_checked_against_the_machine():
    assert worker_device("cpu", {"LOCAL_RANK": "1"}, cuda_devices=2) == CPU
    assert worker_device("cuda:1", {}, cuda_devices=2) == torch.device("cuda", 1)
    assert worker_device("/gpu:0", {}, cuda_devices=1) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"torch sees no CUDA device.*use 'cpu', or install a CUDA build of torch"):
        worker_device("cuda:0", {}, cuda_devices=0)
    with pytest.raises(ValueError, match=r"has 2 CUDA device\(s\) \(cuda:0, cuda:1\); pick one of them or 'cpu'"):
        worker_device("cuda:2", {}, cuda_devices=2)
    with pytest.raises(ValueError, match="not a device name"):
        worker_device("tpu:0", {}, cuda_devices=2)
    with pytest.raises(ValueError, match="LOCAL_RANK='first' is not a whole number"):
        worker_device(None, {"LOCAL_RANK": "first"}, cuda_devices=2)


def test_cpu_indices_are_logical_replicas_of_one_host_cpu():
    assert resolve_device("cpu:1", cuda_devices=0) == ("cpu:1", CPU)


def test_computing_on_a_cpu_changes_nothing():
    with computing_on(CPU):
        assert torch.empty(1).device == CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_computing_on_a_gpu_makes_it_current_and_sets_no_default_device():
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    with computing_on(last):
        assert torch.cuda.current_device() == last.index
        assert torch.empty(1).device == CPU
        assert torch.empty(1, device="cuda").device == last


@pytest.mark.parametrize(
    ("requested", "environ", "gpus", "warns"),
    [
        (None, {}, 4, True),  # nobody placed it: 4 GPUs, it uses none of them
        (None, {"CUDA_VISIBLE_DEVICES": "0,1"}, 2, True),  # the first visible GPU of two
        (None, {"LOCAL_RANK": "2"}, 4, False),  # a launcher runs one worker per GPU
        ("cuda:1", {}, 4, False),  # an explicit placement is trusted
        (None, {}, 1, False),
        (None, {}, 0, False),
    ],
)
def test_a_worker_on_a_machine_with_several_gpus_is_told_how_to_use_them_all(requested, environ, gpus, warns):
    warning = unused_gpus_warning(requested, environ, cuda_devices=gpus)
    assert (warning is not None) == warns
    if warning is not None:
        assert f"{gpus} GPUs" in warning and "--device cuda:I" in warning and "one replica" in warning
