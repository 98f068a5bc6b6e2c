"""`psgd simulate`'s engine: the real consistency rules and shard mechanism on a
virtual clock, in one process.

- `engine`  the event loop, the network's cost model, worker threads run one at a time
- `worker`  a simulated worker (the `Trainer` a schedule drives) and its parameter client
- `run`     one simulated run: shards, workers, evaluator, summary.json and event logs

The command (plan, outputs, report) is psgd/simulate.py; docs/simulation.md describes
the design and the cost model.
"""
