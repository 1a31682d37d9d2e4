"""Hybrid training's dense state in a coordinator's checkpoint (``sync_dense=True``).

The replicated dense variables live on the workers, not on the parameter servers, so a
checkpoint holds them in a file of their own beside the servers' shards: their values, their
optimizer's state, how many steps were applied and the step keys applied (so that a closure
retried after a restore is still applied once). The manifest names the file with its SHA-256;
the file is written into the staged checkpoint before it is committed, so it is whole with it.
A restore reads it as every checkpoint file is read (psserver/checkpoint/integrity.py: confined,
hashed, weights only) and checks each tensor against the live variables and their optimizer
(``check_dense_state``) before anything changes.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from paramserve.psserver.checkpoint import integrity
from paramserve.psserver.protocol.errors import CheckpointError, ParamServeError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec, build_torch_optimizer

__all__ = [
    "DENSE_EXTRA_KEY",
    "DENSE_STATE_FILE",
    "check_dense_state",
    "read_checkpoint_state",
    "write_checkpoint_state",
]

DENSE_STATE_FILE = "dense_state.pt"
"""Where a checkpoint keeps the replicated variables and their optimizer state (torch.save)."""
DENSE_EXTRA_KEY = "dense_state"
"""The checkpoint manifest's entry for that file: its name and SHA-256."""
_WHAT = "dense state"


def write_checkpoint_state(directory: pathlib.Path, state: Mapping[str, Any]) -> dict[str, str]:
    """Writes ``state`` into a checkpoint being staged (fsynced); returns its manifest entry."""
    digest = integrity.write_hashed(directory / DENSE_STATE_FILE, lambda file: torch.save(dict(state), file))
    return {"file": DENSE_STATE_FILE, integrity.HASH_KEY: digest}


def read_checkpoint_state(directory: pathlib.Path, entry: Mapping[str, str]) -> dict[str, Any]:
    """The dense state a checkpoint holds: values, optimizer state, version and applied keys.
    Raises CheckpointError naming the file when it is missing, not confined to the checkpoint,
    not the one the manifest names (its SHA-256), or not a dense state."""
    name, digest = entry.get("file", DENSE_STATE_FILE), entry.get(integrity.HASH_KEY)
    if not isinstance(digest, str):
        raise CheckpointError(f"checkpoint {directory} names its {_WHAT} without a SHA-256: restore another one")
    state = integrity.load_file(directory, name, digest, _WHAT)
    values = state.get("values") if isinstance(state, dict) else None
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    if not (
        isinstance(values, dict)
        and all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in values.items())
        and isinstance(state.get("version"), int)
        and isinstance(state.get("applied"), list)
        and all(isinstance(key, int) for key in state["applied"])
        and (optimizer is None or isinstance(optimizer, dict))
    ):
        raise CheckpointError(f"{_WHAT} {directory / str(name)} holds no values, version and applied keys")
    return state


def check_dense_state(
    path: pathlib.Path,
    state: Mapping[str, Any],
    parameters: Mapping[str, torch.Tensor],
    groups: Sequence[tuple[Sequence[str], OptimizerSpec]] | None,
) -> None:
    """Raises CheckpointError, naming the checkpoint's dense state and what differs, unless
    ``state`` fits the live replicated variables: ``parameters`` (by checkpoint key) each of the
    saved value's shape and dtype, and, with ``groups`` (the workers' param groups: checkpoint
    keys and optimizer, in order), an optimizer state of those groups and of the slots their
    optimizer keeps for each variable."""
    where = f"{_WHAT} {path / DENSE_STATE_FILE}"
    for key, live in parameters.items():
        saved = state["values"].get(key)
        if saved is None:
            raise CheckpointError(f"{where} holds no value of {key!r}")
        if (tuple(saved.shape), saved.dtype) != (tuple(live.shape), live.dtype):
            raise CheckpointError(
                f"{where} holds {key!r} as {tuple(saved.shape)} {saved.dtype}; the model's is "
                f"{tuple(live.shape)} {live.dtype}: restore a checkpoint of this model"
            )
    if state["optimizer"] is not None and groups is not None:
        problem = _optimizer_problem(state["optimizer"], parameters, groups)
        if problem is not None:
            raise CheckpointError(f"{where}: its optimizer state {problem}: restore a checkpoint of this model")


def _optimizer_problem(
    saved: Mapping[str, Any],
    parameters: Mapping[str, torch.Tensor],
    groups: Sequence[tuple[Sequence[str], OptimizerSpec]],
) -> str | None:
    """What in a torch optimizer's ``state_dict`` does not fit ``groups`` (None: nothing)."""
    saved_groups, per_parameter = saved.get("param_groups"), saved.get("state")
    sizes = [len(names) for names, _ in groups]
    if not isinstance(saved_groups, list) or not isinstance(per_parameter, dict):
        return "is not a torch optimizer's state_dict"
    found = [
        len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else -1 for g in saved_groups
    ]
    if found != sizes:
        return f"has param groups of {found} variables, not {sizes}"
    try:
        expected = _slot_layouts(parameters, groups)
    except (ParamServeError, RuntimeError, ValueError, TypeError):
        return None  # this optimizer cannot step a stand-in: the workers' load_state_dict checks it
    for index, slots in per_parameter.items():
        layout = expected.get(index) if isinstance(index, int) else None
        if layout is None or not isinstance(slots, dict):
            return f"names variable number {index!r}, of {len(expected)}"
        held = {k: (tuple(v.shape), v.dtype) for k, v in slots.items() if isinstance(v, torch.Tensor)}
        if held != layout or len(held) != len(slots):
            return f"for variable number {index} is {held}; {layout} expected"
    return None


def _slot_layouts(
    parameters: Mapping[str, torch.Tensor], groups: Sequence[tuple[Sequence[str], OptimizerSpec]]
) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The state torch keeps for each variable (numbered as a state_dict numbers them) after a
    step: found by stepping each group's optimizer once on stand-ins of the variables' shapes
    on the meta device (no memory), built as the servers build theirs (never captured by a scope)."""
    layouts: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    for names, spec in groups:
        stand_ins = [torch.nn.Parameter(torch.empty_like(parameters[name], device="meta")) for name in names]
        for stand_in in stand_ins:
            stand_in.grad = torch.empty_like(stand_in)
        optimizer = build_torch_optimizer(spec, stand_ins)
        optimizer.step()
        for stand_in in stand_ins:
            state = optimizer.state[stand_in]
            layouts[len(layouts)] = {k: (tuple(v.shape), v.dtype) for k, v in state.items() if torch.is_tensor(v)}
    return layouts
