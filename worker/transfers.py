"""How a worker's values cross between host memory and the device it computes on.

The client of the parameter servers reads and writes host (CPU) tensors; a worker computes
on one device (``paramserve worker --device``), where its distributed parameters live.
``transfers_for(device)`` gives what the worker's core uses:

- ``HostTransfers`` (a CPU worker): nothing crosses. The client pulls straight into the
  parameters (the one copy out of the received message); gradients go to the wire as they
  are. A CPU worker pays nothing for the GPU path: no pinned buffers, no extra copies.
- ``CudaTransfers`` (a GPU worker): pulls land in pinned host buffers, one per variable and
  reused, and are copied to the parameters asynchronously on the current stream; gradients
  are copied device -> pinned buffer (one per variable) asynchronously, then the stream is
  synchronised once and the client sends the buffers. Before the client writes into the
  pull buffers again, the worker waits for an event recorded after the last copies out of
  them, so a buffer is never overwritten while a copy still reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from paramserve.psserver.protocol.types import RowGradient

__all__ = ["CudaTransfers", "HostTransfers", "Transfers", "transfers_for"]

Gradients = Mapping[str, torch.Tensor | RowGradient]


class Transfers(Protocol):
    """What a worker's core asks about its device."""

    device: torch.device

    def pull_destinations(self, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Host tensors for the client to pull these variables into (shaped like their
        parameters), safe to overwrite now; None: let the client allocate."""

    def fill(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies each pulled host value into its parameter: ``(parameter, value)`` pairs."""

    def to_host(self, gradients: Gradients) -> dict[str, torch.Tensor | RowGradient]:
        """The gradients as host tensors the client may send (their data is there on return)."""

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (embedding rows pulled for a lookup)."""


class HostTransfers:
    """A CPU worker's: values stay where they are."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def pull_destinations(self, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        return {name: parameter.detach() for name, parameter in parameters.items() if parameter.is_contiguous()}

    def fill(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for parameter, value in copies:
                if value.data_ptr() != parameter.data_ptr() or not value.numel():  # else pulled in place
                    parameter.copy_(value)

    def to_host(self, gradients: Gradients) -> dict[str, torch.Tensor | RowGradient]:
        return dict(gradients)

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        return value


class CudaTransfers:
    """A GPU worker's: pinned host buffers and asynchronous copies (see the module docstring).

    Used by one closure at a time (the core runs closures one by one), from whichever
    thread runs it; the copies go on the device's current stream in that thread (the
    default stream unless user code chose another), as the user's kernels do.
    """

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaTransfers needs a CUDA device, got {device}")
        self.device = device
        self._pulled: dict[str, torch.Tensor] = {}  # where pulls land, by variable
        self._pushed: dict[str, torch.Tensor] = {}  # where gradients leave from, by variable
        self._copied_out: torch.cuda.Event | None = None
        """Recorded after the last copies out of the pull buffers."""

    def pull_destinations(self, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._copied_out is not None:
            self._copied_out.synchronize()  # the client is about to overwrite what those copies read
            self._copied_out = None
        return {name: _pinned(self._pulled, name, parameter) for name, parameter in parameters.items()}

    def fill(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for parameter, value in copies:
                parameter.copy_(value, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copied_out = event

    def to_host(self, gradients: Gradients) -> dict[str, torch.Tensor | RowGradient]:
        host: dict[str, torch.Tensor | RowGradient] = {}
        for name, gradient in gradients.items():
            if isinstance(gradient, RowGradient):
                # Rows differ in number from step to step: a pinned tensor of their size (torch's
                # pinned-memory cache makes that cheap); the indices are already host tensors.
                values = gradient.values
                if values.device.type != "cpu":
                    values = _copy_out(values, torch.empty(values.shape, dtype=values.dtype, pin_memory=True))
                host[name] = RowGradient(gradient.indices.to("cpu"), values)
            elif gradient.device.type != "cpu":
                host[name] = _copy_out(gradient, _pinned(self._pushed, name, gradient))
            else:
                host[name] = gradient  # a parameter the user kept on the host
        # Once: every copy above (and the backward pass before them) is on this stream.
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def to_device(self, value: torch.Tensor) -> torch.Tensor:
        return value.to(self.device)


def _pinned(buffers: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """``buffers[name]``, a pinned host tensor shaped like ``like`` (made or remade to fit)."""
    buffer = buffers.get(name)
    if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
        buffer = buffers[name] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return buffer


def _copy_out(value: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """Starts copying device ``value`` into pinned ``host`` (asynchronous: the caller synchronises)."""
    host.copy_(value.detach(), non_blocking=True)
    return host


def transfers_for(device: torch.device) -> Transfers:
    """A worker's transfers for ``device``: the CPU's (nothing moves) or a GPU's.

    Raises ValueError for another kind of device."""
    if device.type == "cpu":
        return HostTransfers()
    if device.type == "cuda":
        return CudaTransfers(device)
    raise ValueError(f"a worker computes on the CPU or a CUDA GPU, not on {device}")
