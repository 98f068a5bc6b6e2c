"""Daemons that compute: the worker (training loop + parameter client) and the evaluator."""
