"""Where a paramserve process computes: device names, a worker's default device, and the
current CUDA device of a thread.

Every process shares these rules: the in-process strategies parse their replica devices
with ``resolve_device``, and ``paramserve worker`` its ``--device`` flag (``worker_device``).

Nothing here sets torch's *default device* (``with torch.device(...)``,
``torch.set_default_device``). That mode makes every tensor constructor of the thread
allocate on the device, the user's input pipelines included (``torch.randperm`` with a
CPU ``torch.Generator`` then fails on a GPU machine), and it intercepts every torch call.
``computing_on`` only makes a GPU the thread's *current CUDA device*: where kernels and
streams without an explicit device go, and what ``"cuda"`` means. Tensors a step creates
go where its code says, as everywhere in PyTorch; what a strategy or a worker places
(parameters, inputs) it places explicitly.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping

import torch

__all__ = ["CPU", "computing_on", "cuda_device_count", "resolve_device", "worker_device"]

_DEVICE = re.compile(r"^(?:.*device:)?/?(cpu|gpu|cuda)(?::(\d+))?$", re.IGNORECASE)

LOCAL_RANK_ENV = "LOCAL_RANK"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


CPU = torch.device("cpu")
"""The host: where a worker computes without a GPU, and where tensors cross the wire."""


def cuda_device_count() -> int:
    """The CUDA devices torch can use here (0 on a CPU-only build or without a driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str | torch.device, cuda_devices: int | None = None) -> tuple[str, torch.device]:
    """A device name ("cpu:1", "cuda:0") and the torch device it runs on.

    CPU indices are logical: "cpu:0" and "cpu:1" are two replicas on the host CPU.
    TF spellings ("/gpu:0", "/job:localhost/replica:0/task:0/device:GPU:0") are accepted.
    ``cuda_devices``: the CUDA devices to check against (default: this machine's).

    Raises:
        ValueError: unparsable name, or a CUDA device this machine does not have (the
            message names the devices it has, and what to do when it has none).
    """
    match = _DEVICE.match(str(spec).strip())
    if match is None:
        raise ValueError(f"{spec!r} is not a device name: use 'cpu', 'cpu:N' or 'cuda:N' (TF's '/gpu:N' works too)")
    kind, index = match.group(1).lower(), int(match.group(2) or 0)
    if kind == "cpu":
        return f"cpu:{index}", torch.device("cpu")
    count = cuda_device_count() if cuda_devices is None else cuda_devices
    if count == 0:
        raise ValueError(
            f"device {str(spec)!r} does not exist: torch sees no CUDA device on this machine "
            "(torch.cuda.is_available() is False: a CPU-only torch build, no NVIDIA driver, or "
            f"{VISIBLE_DEVICES_ENV} hiding the GPUs); use 'cpu', or install a CUDA build of torch"
        )
    if index >= count:
        available = ", ".join(f"cuda:{i}" for i in range(count))
        raise ValueError(
            f"device {str(spec)!r} does not exist: this machine has {count} CUDA device(s) ({available}); "
            "pick one of them or 'cpu'"
        )
    return f"cuda:{index}", torch.device("cuda", index)


def worker_device(
    requested: str | None, environ: Mapping[str, str] | None = None, cuda_devices: int | None = None
) -> torch.device:
    """The device a worker computes on.

    ``requested`` (``--device``) when given. Otherwise, where CUDA is available and a launcher
    placed this process: ``LOCAL_RANK`` set (torchrun, Slurm and the like) gives GPU
    ``LOCAL_RANK`` modulo the visible GPUs (workers may share a GPU: each is its own process),
    ``CUDA_VISIBLE_DEVICES`` alone gives the first visible GPU. Otherwise the CPU: a worker
    nobody placed does not take a GPU, and without CUDA ``LOCAL_RANK`` means nothing.

    Raises:
        ValueError: ``requested`` is not a device name or names a GPU this machine lacks, or
            ``LOCAL_RANK`` is not a whole number where CUDA is available.
    """
    count = cuda_device_count() if cuda_devices is None else cuda_devices
    if requested is not None:
        return resolve_device(requested, count)[1]
    env = os.environ if environ is None else environ
    if count == 0:
        return torch.device("cpu")
    local_rank = env.get(LOCAL_RANK_ENV, "").strip()
    if local_rank:
        if not local_rank.isdigit():
            raise ValueError(f"{LOCAL_RANK_ENV}={local_rank!r} is not a whole number: unset it or pass --device")
        return torch.device("cuda", int(local_rank) % count)
    if env.get(VISIBLE_DEVICES_ENV, "").strip():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def unused_gpus_warning(
    requested: str | None, environ: Mapping[str, str] | None = None, cuda_devices: int | None = None
) -> str | None:
    """Why a worker nobody placed leaves GPUs idle, or None.

    A paramserve worker is one replica on one device (``num_replicas_in_sync`` is 1), where
    TensorFlow's parameter-server worker mirrors its step over every GPU of its machine. A
    worker started without ``--device`` or ``LOCAL_RANK`` on a machine with several GPUs
    would silently use one (or none): this names the fix. Explicit placements are trusted.
    """
    count = cuda_device_count() if cuda_devices is None else cuda_devices
    env = os.environ if environ is None else environ
    if count < 2 or requested is not None or env.get(LOCAL_RANK_ENV, "").strip():
        return None
    used = worker_device(None, env, count)
    return (
        f"this machine has {count} GPUs and this worker computes on {used} alone: a paramserve worker is "
        "one replica on one device (unlike TensorFlow's, which mirrors over its machine's GPUs); start one "
        f"worker per GPU (paramserve worker --device cuda:I for I in 0..{count - 1}, or a launcher setting "
        f"{LOCAL_RANK_ENV}) to use them all"
    )


@contextlib.contextmanager
def computing_on(device: torch.device) -> Iterator[None]:
    """While open, a CUDA ``device`` is this thread's current CUDA device (kernels and streams
    without an explicit device, and ``"cuda"``, mean it); for any other device, nothing.
    Sets no default device for tensor constructors (see the module's docstring)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield
