"""Keras-style training under any strategy: ``fit``, ``evaluate``, ``predict`` and their callbacks."""

from paramserve.coordinator.training.fit import evaluate, fit, predict

__all__ = ["evaluate", "fit", "predict"]
