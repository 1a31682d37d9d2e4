"""Hybrid training's dense state in a coordinator's checkpoint (``sync_dense=True``).

The replicated dense variables live on the workers, not on the parameter servers, so a
checkpoint holds them in a file of their own beside the servers' shards: their values, their
optimizer's state, how many steps were applied and the step keys applied (so that a closure
retried after a restore is still applied once). The manifest names the file with its SHA-256;
the file is written into the staged checkpoint before it is committed, so it is whole with it.
"""

from __future__ import annotations

import hashlib
import io
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["DENSE_EXTRA_KEY", "DENSE_STATE_FILE", "read_checkpoint_state", "write_checkpoint_state"]

DENSE_STATE_FILE = "dense_state.pt"
"""Where a checkpoint keeps the replicated variables and their optimizer state (torch.save)."""
DENSE_EXTRA_KEY = "dense_state"
"""The checkpoint manifest's entry for that file: its name and SHA-256."""


def write_checkpoint_state(directory: pathlib.Path, state: Mapping[str, Any]) -> dict[str, str]:
    """Writes ``state`` into a checkpoint being staged; returns its manifest entry."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    data = buffer.getvalue()
    (directory / DENSE_STATE_FILE).write_bytes(data)
    return {"file": DENSE_STATE_FILE, "sha256": hashlib.sha256(data).hexdigest()}


def read_checkpoint_state(directory: pathlib.Path, entry: Mapping[str, str]) -> dict[str, Any]:
    """The dense state a checkpoint holds. Raises ValueError when its file is missing or not the
    one the manifest names (a damaged checkpoint: restore another one)."""
    path = directory / str(entry.get("file", DENSE_STATE_FILE))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"checkpoint {directory} lacks its dense state {path.name}: restore another one") from exc
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise ValueError(f"checkpoint {directory}: {path.name} does not match its manifest: restore another one")
    state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return state
