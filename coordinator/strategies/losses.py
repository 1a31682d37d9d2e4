"""Loss scaling so that N replicas make the same update as one device on the global batch.

Replicas' gradients are *summed* at ``optimizer.step()``; so each replica's
loss must be its share of the global mean: sum of its per-example losses
divided by the *global* batch size (tf.nn.compute_average_loss).
"""

from __future__ import annotations

import torch

from paramserve.coordinator.strategies.base import get_replica_context, get_strategy


def _num_replicas() -> int:
    context = get_replica_context()
    return context.num_replicas_in_sync if context is not None else get_strategy().num_replicas_in_sync


def compute_average_loss(
    per_example_loss: torch.Tensor,
    global_batch_size: int | None = None,
    sample_weight: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Sum of ``per_example_loss`` (times ``sample_weight``) divided by the global batch size.

    Args:
        per_example_loss: one loss per example, first dimension = this replica's batch
            (compute it with ``reduction="none"``).
        global_batch_size: default ``per-replica batch x num_replicas_in_sync``, as TF. Pass
            it explicitly when batches can be short (a last partial batch split unevenly).
        sample_weight: multiplies the per-example losses (a scalar or broadcastable tensor).

    Returns a scalar; 0 (with a gradient) for a replica that got an empty batch.

    Raises:
        ValueError: for a scalar loss (already reduced) or a non-positive global batch size.
    """
    if per_example_loss.dim() == 0:
        raise ValueError(
            "compute_average_loss got a scalar, i.e. a loss already averaged over the replica's batch: "
            "compute the loss with reduction='none' so that it has one value per example"
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * torch.as_tensor(sample_weight, device=per_example_loss.device)
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _num_replicas()
        if global_batch_size == 0:
            return per_example_loss.sum()  # an empty share of a short batch contributes nothing
    elif global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return per_example_loss.sum() / global_batch_size


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """Divides a regularization loss by ``num_replicas_in_sync``: every replica adds it, and
    the replicas' gradients are summed, so the total counts it once."""
    return regularization_loss / _num_replicas()
