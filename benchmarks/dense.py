"""Dense-layer parameters and regression batches shared by the benchmarks (NumPy only)."""

from __future__ import annotations

import numpy as np


def dense_layers(rng: np.random.Generator, depth: int, width: int) -> list[dict[str, np.ndarray]]:
    """``depth`` layers of ``width x width`` weights (scaled by ``1/sqrt(width)``) and zero biases."""
    return [
        {"w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), "b": np.zeros(width, np.float32)}
        for _ in range(depth)
    ]


def regression_batches(rng: np.random.Generator, count: int, batch: int, width: int) -> list[dict[str, np.ndarray]]:
    """``count`` batches of ``batch`` rows: normal inputs ``x`` and targets ``y``, both ``width`` wide."""
    return [
        {
            "x": rng.normal(size=(batch, width)).astype(np.float32),
            "y": rng.normal(size=(batch, width)).astype(np.float32),
        }
        for _ in range(count)
    ]
