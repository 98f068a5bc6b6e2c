"""Elastic averaging SGD (Zhang, Choromanska, LeCun 2015): the centre's arithmetic.

Asynchronous (Algorithm 1), at the steps t of worker i with tau | t, with the x_i that
the step's gradient is computed at:
    d = alpha * (x_i - center);  center += d;  x_i -= d (then x_i -= eta * g(x_i, the same))
Synchronous rounds, over the round's x_i and the centre before the round:
    d_i = alpha * (x_i - center);  center += sum_i d_i;  x_i -= d_i
Works on numpy arrays or torch tensors; nothing is changed in place.
"""
from __future__ import annotations


def elastic_delta(x_i, center, alpha: float):
    """How far worker i and the centre move towards each other: alpha * (x_i - center)."""
    return alpha * (x_i - center)


def round_deltas(xs, center, alpha: float) -> list:
    """A synchronous round: each worker's d_i (the centre moves by their sum)."""
    return [elastic_delta(x, center, alpha) for x in xs]


def default_alpha(alpha: float, workers: int) -> float:
    """`mode.alpha = 0` means 0.9 / W (the paper's beta = 0.9 split over the workers)."""
    return alpha if alpha > 0 else 0.9 / max(1, workers)
