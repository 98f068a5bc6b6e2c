"""Consistency rules as pure state machines: no sockets, no threads, no tensors.

The shard server feeds them events (a push, a read, a membership change) and acts on
what they answer (apply, drop, answer these parked reads). Unit and property tests
drive them directly.

- `barrier.StepBarrier`  — sync (BSP) steps with backup workers; easgd's sync rounds
- `clock.ClockTable`     — ssp's bounded staleness gate (async is the unbounded case)
- `staleness`            — staleness-aware learning rate, delay compensation, histograms
- `elastic`              — the EASGD center update
- `tournament`           — LTFB pairings, adoption, and the model exchange
"""
