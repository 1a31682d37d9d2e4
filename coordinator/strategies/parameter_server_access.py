"""How code outside ParameterServerStrategy reaches its variables on the parameter servers.

The coordinator's own modules read and update them through CoordinatorAccess (the
VariableAccess of the coordinator); a closure pickled to a worker carries the strategy
as ClosureStrategy (one replica, no clients, no locks: the worker's access does the
rest); a torch optimizer built in ``strategy.scope()`` steps through its ServerOptimizer
(ServerOptimizerLink, found again by server_optimizer_of). They are apart from
``parameter_server`` (the strategy that creates and owns the variables) because they
are the strategy's faces to other code: each holds the strategy or a ServerOptimizer,
and none of them creates variables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paramserve.coordinator.strategies import _capture
from paramserve.coordinator.strategies.base import SingleReplicaStrategy
from paramserve.worker.layers import ServerOptimizer, variable_name

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy


class ClosureStrategy(SingleReplicaStrategy):
    """What a ParameterServerStrategy is inside a closure on a worker: one replica,
    no clients, no locks (a pickled ParameterServerStrategy unpickles as one)."""


class CoordinatorAccess:
    """VariableAccess of the coordinator: its own modules read the servers' current values."""

    def __init__(self, strategy: ParameterServerStrategy):
        self._strategy: ParameterServerStrategy | None = strategy

    def close(self) -> None:
        self._strategy = None

    @property
    def owner(self) -> ParameterServerStrategy | None:
        """The strategy, None once it was closed."""
        return self._strategy

    @property
    def strategy(self) -> ParameterServerStrategy:
        if self._strategy is None:
            raise RuntimeError("the ParameterServerStrategy these variables belong to was closed")
        return self._strategy

    def parameter(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
        variable = self.strategy.variables.get(name)
        if variable is None or variable.parameter is None:
            raise KeyError(f"no dense variable {name!r} in this strategy")
        return variable.parameter

    def refresh(self, parameters: Sequence[nn.Parameter]) -> None:
        if not self.strategy.materialized or not parameters:
            return  # before training, the local values are the variables' values
        sync_dense = self.strategy.sync_dense
        if sync_dense is not None and any(n and sync_dense.holds(n) for n in map(variable_name, parameters)):
            sync_dense.refresh()  # the coordinator's parameters are the replicated variables
        # A model built after training started holds its variables' values until they are created.
        names = [n if n and self.strategy.is_created(n) else None for n in map(variable_name, parameters)]
        if not any(names):
            return
        pulled = self.strategy.client.pull([n for n in names if n])
        with torch.no_grad():
            for param, name in zip(parameters, names):
                if name:
                    param.copy_(pulled.tensors[name])

    def place(self, module: nn.Module) -> None:
        return None  # the coordinator computes where the user put the module

    def lookup(self, lookups: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.strategy.materialize()
        found, _ = self.strategy.client.pull_unique_rows(lookups)
        return {name: rows.gathered(lookups[name].shape) for name, rows in found.items()}

    def lookup_dynamic(self, table: str, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """A dynamic table's rows for ``ids`` as the servers hold them (no gradient); a lookup
        here counts towards admission as a worker's does."""
        self.strategy.materialize()
        found, _ = self.strategy.client.pull_unique_rows({table: ids}, dynamic={table: (dim, dtype)})
        return found[table].gathered(ids.shape)

    def apply_gradients(self, names: Sequence[str]) -> None:
        sync_dense = self.strategy.sync_dense
        if sync_dense is not None and any(sync_dense.holds(name) for name in names):
            raise RuntimeError(
                "under sync_dense the dense variables are trained on the workers only: call optimizer.step() in a "
                "closure scheduled with ClusterCoordinator.schedule()"
            )
        self.strategy.materialize()
        gradients = {}
        for name in names:
            variable = self.strategy.variables[name]
            if variable.parameter is not None and variable.parameter.grad is not None:
                gradients[name] = variable.parameter.grad
        if gradients:
            self.strategy.client.push(gradients)

    def settle_replicated(self) -> None:
        return None  # the coordinator reads the workers' settled state (refresh)

    def zero_grad(self, names: Sequence[str], set_to_none: bool) -> None:
        for name in names:
            param = self.strategy.variables[name].parameter
            if param is not None and param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()


class ServerOptimizerLink:
    """What a torch optimizer built in a ParameterServerStrategy's scope does (its ``_capture``
    link): ``step`` and ``zero_grad`` are the ServerOptimizer's, on the wire it is that
    ServerOptimizer, and its local state is refused (it lives on the servers)."""

    def __init__(self, server_optimizer: ServerOptimizer, optimizer: torch.optim.Optimizer | None = None):
        self.server_optimizer = server_optimizer
        self._optimizer = optimizer

    def step(self, closure: Any = None) -> Any:
        self._refuse_step_hooks()
        return self.server_optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.server_optimizer.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError(_STATE_ON_SERVERS + "restore it with CheckpointManager(strategy, directory).restore(...)")

    def state_dict(self) -> dict[str, Any]:
        """Refused rather than answered with the coordinator's empty local state: a file saved
        from it would restore no momentum or moments, and the loss would show it only later."""
        raise RuntimeError(
            _STATE_ON_SERVERS + "save it, with the variables, by CheckpointManager(strategy, directory).save(step), "
            "or export the model's weights alone with export_state_dict(strategy, path, model)"
        )

    def pickled_as(self) -> ServerOptimizer:
        self._refuse_step_hooks()
        return self.server_optimizer

    def _refuse_step_hooks(self) -> None:
        """Refuses an optimizer with step hooks of its own: torch runs them inside its ``step()``,
        and this optimizer's steps are the ServerOptimizer's (sent to the workers in closures),
        which cannot run code that lives in this process. Without this the hooks (a gradient
        clip, an average of the weights, a log line) would silently never run."""
        if self._optimizer is None:
            return
        hooks = step_hook_count(self._optimizer)
        if hooks:
            raise RuntimeError(
                f"this {type(self._optimizer).__name__} has {hooks} step hook(s) (register_step_pre_hook / "
                "register_step_post_hook), which would never run: under ParameterServerStrategy its steps are "
                "pushes to the parameter servers, made on the workers in the closures it is sent with. Do the "
                "hook's work in the step function, before or after optimizer.step(), and remove the hooks "
                "(handle.remove())"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the servers' optimizers are declared when the scope closes, and a group
        added locally afterwards would never be stepped."""
        raise RuntimeError(
            "this optimizer's variables were declared to the parameter servers when its strategy.scope() "
            "closed: a param group added now would never train; add it inside that scope, or declare "
            "another optimizer for those parameters with strategy.optimizer(...)"
        )


def step_hook_count(optimizer: torch.optim.Optimizer) -> int:
    """How many step hooks ``optimizer`` has of its own (torch's process-wide ones are not its)."""
    pre: Mapping[Any, Any] = getattr(optimizer, "_optimizer_step_pre_hooks", {})
    post: Mapping[Any, Any] = getattr(optimizer, "_optimizer_step_post_hooks", {})
    return len(pre) + len(post)


_STATE_ON_SERVERS = (
    "an optimizer of a ParameterServerStrategy keeps its state (momentum, moments, step counts) on the "
    "parameter servers, not in this process: "
)


def server_optimizer_of(optimizer: Any) -> ServerOptimizer:
    """The ServerOptimizer behind ``optimizer``: itself, or the one a torch optimizer built in
    scope steps through.

    Raises:
        TypeError: ``optimizer`` is neither (it updates no variable of a ParameterServerStrategy).
    """
    if isinstance(optimizer, ServerOptimizer):
        return optimizer
    link = vars(optimizer).get(_capture.LINK)
    if isinstance(link, ServerOptimizerLink):
        return link.server_optimizer
    raise TypeError(
        f"{type(optimizer).__name__} does not update this strategy's variables: use the optimizer "
        "strategy.optimizer(...) returns, or a torch optimizer built inside strategy.scope()"
    )
