"""A custom training loop with MirroredStrategy: TensorFlow's tutorial, in paramserve.

Read it beside the TensorFlow guide's custom-training-loop section: the same steps in the
same order (strategy, distributed dataset, model/optimizer/metrics in scope, a replica step
that averages the loss over the global batch, strategy.run and strategy.reduce, the loop).
scikit-learn's digits stand in for MNIST; without GPUs there are two CPU replicas.

    python examples/custom_training_loop.py [--epochs 5]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator import MirroredStrategy, ReduceOp, compute_average_loss, metrics
from paramserve.coordinator.demos.digits import digits_split


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    # Create a strategy
    strategy = MirroredStrategy() if torch.cuda.device_count() > 1 else MirroredStrategy(["cpu:0", "cpu:1"])
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # Prepare the dataset, and distribute it: each global batch is split across the replicas
    x_train, y_train, x_test, y_test = digits_split()
    batch_size = 64 * strategy.num_replicas_in_sync
    train_dataset = DataLoader(
        TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    dist_dataset = strategy.experimental_distribute_dataset(train_dataset)

    # Create the model, the optimizer and the metrics within the strategy's scope
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
        train_accuracy = metrics.SparseCategoricalAccuracy(name="train_accuracy")
    # reduction="none": compute_average_loss divides by the global batch (TF: Reduction.NONE)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    # Define the training step (one replica's share of the batch)
    def train_step(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        predictions = model(features)
        loss = compute_average_loss(loss_fn(predictions, labels))  # over the global batch
        loss.backward()
        optimizer.step()  # the replicas' gradients are summed first (TF: apply_gradients)
        train_accuracy.update_state(predictions, labels)
        return loss

    # Define the distributed training step
    def distributed_train_step(inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        per_replica_losses = strategy.run(train_step, args=inputs)
        return strategy.reduce(ReduceOp.SUM, per_replica_losses, axis=None)

    # Training loop
    epoch_loss = 0.0
    for epoch in range(args.epochs):
        total_loss = 0.0
        num_batches = 0
        train_accuracy.reset_state()  # reset metrics for each epoch
        for step, batch in enumerate(dist_dataset):
            loss = distributed_train_step(batch)
            total_loss += loss  # a plain tensor: reduce() results carry no autograd graph
            num_batches += 1
            if step % 10 == 0:
                print(f"Epoch {epoch + 1}, Step {step}, Loss: {float(loss):.4f}")
        epoch_loss = float(total_loss / num_batches)
        print(f"Epoch {epoch + 1}, Loss: {epoch_loss:.4f}, Accuracy: {float(train_accuracy.result()):.4f}")

    with torch.no_grad():
        test_accuracy = float((model(x_test).argmax(-1) == y_test).float().mean())
    print(f"Test accuracy: {test_accuracy:.4f}")
    result = {"loss": epoch_loss, "train_accuracy": float(train_accuracy.result()), "test_accuracy": test_accuracy}
    strategy.close()
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
