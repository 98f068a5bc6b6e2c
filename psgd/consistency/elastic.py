"""Elastic averaging SGD (Zhang, Choromanska, LeCun 2015).

Asynchronous (Algorithm 1), every tau local steps of worker i:
    d = alpha * (x_i - center);  center += d;  x_i -= d
Synchronous rounds: the round's center update is
    center += alpha * sum_i (x_i - center_old)
and worker i moves by d_i = alpha * (x_i - center_old).
Works on numpy arrays or torch tensors; `center` is updated in place.
"""
from __future__ import annotations


def elastic_step(x_i, center, alpha: float):
    """Asynchronous exchange: returns d; center is moved by +d in place."""
    d = alpha * (x_i - center)
    center += d
    return d


def elastic_round(xs, center, alpha: float):
    """Synchronous round over all x_i: returns the list of d_i; center moves by sum(d_i)."""
    ds = [alpha * (x - center) for x in xs]
    for d in ds:
        center += d
    return ds
