"""`psgd simulate`'s engine: the real consistency rules and shard mechanism on a
virtual clock, in one process.

- `engine`    the event loop, the network's cost model, worker threads run one at a time
- `messages`  messages handed over in process (what the wire would deliver, and its size)
- `worker`    a simulated worker (the `Trainer` a schedule drives) and its parameter client
- `timing`    the shard and replica of timing-only runs (no arithmetic)
- `run`       one simulated run: shards, workers, evaluator, summary.json and event logs

The command (plan, outputs, report) is psgd/simulate.py; docs/simulation.md describes
the design and the cost model.
"""
