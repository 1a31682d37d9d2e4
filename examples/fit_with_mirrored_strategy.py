"""Distributed training with fit and MirroredStrategy: TensorFlow's Keras tutorial, in paramserve.

Read it beside the TensorFlow tutorial: the sections are the same, in the same order.
The data set is scikit-learn's bundled digits (8x8 images, no download) instead of MNIST;
on a machine without GPUs MirroredStrategy runs two CPU replicas.

    python examples/fit_with_mirrored_strategy.py [--epochs 10] [--workdir DIR]
"""

from __future__ import annotations

# Import dependencies
import argparse
import os
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator import MirroredStrategy, callbacks, evaluate, fit, latest_checkpoint
from paramserve.coordinator.demos.digits import digits_split


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--workdir", default=None, help="checkpoints, logs and the exported model (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="fit-mirrored-")

    # Load the dataset (TF: tfds.load('mnist')); pixels are already scaled to [0, 1]
    x_train, y_train, x_test, y_test = digits_split()
    num_train_examples = len(x_train)

    # Define the distribution strategy
    strategy = MirroredStrategy() if torch.cuda.device_count() > 1 else MirroredStrategy(["cpu:0", "cpu:1"])
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # Set up the input pipeline: the global batch is split across the replicas
    batch_size_per_replica = 32
    batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    train_dataset = DataLoader(TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True)
    eval_dataset = DataLoader(TensorDataset(x_test, y_test), batch_size=batch_size)

    # Create the model, and its optimizer, in the strategy's scope ("compile": the loss and
    # the optimizer are fit's arguments; the loss keeps one value per example)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = nn.CrossEntropyLoss(reduction="none")

    # Define the callbacks
    checkpoint_dir = os.path.join(workdir, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.pt")

    def decay(epoch: int) -> float:
        if epoch < 3:
            return 1e-3
        if epoch < 7:
            return 1e-4
        return 1e-5

    class PrintLR(callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            print(f"\nLearning rate for epoch {epoch + 1} is {optimizer.param_groups[0]['lr']}")

    callback_list = [
        callbacks.TensorBoard(log_dir=os.path.join(workdir, "logs")),
        callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]

    # Train and evaluate: the same call with or without a strategy
    fit(model, optimizer, loss, train_dataset, epochs=args.epochs, callbacks=callback_list, verbose=False)
    print(sorted(os.listdir(checkpoint_dir)))

    model.load_state_dict(torch.load(latest_checkpoint(checkpoint_dir), weights_only=True))
    eval_loss, eval_acc = evaluate(model, loss, eval_dataset)
    print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")

    # Export: a plain state_dict, loaded without the strategy's scope (TF: a SavedModel)
    path = os.path.join(workdir, "saved_model.pt")
    torch.save(model.state_dict(), path)
    strategy.close()
    unreplicated_model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    unreplicated_model.load_state_dict(torch.load(path, weights_only=True))
    eval_loss, eval_acc = evaluate(unreplicated_model, loss, eval_dataset)
    print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")
    return {"eval_loss": eval_loss, "eval_accuracy": eval_acc, "examples": num_train_examples}


if __name__ == "__main__":
    main()
    sys.exit(0)
