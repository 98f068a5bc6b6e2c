"""A shard under a daemon lends its tables to its replies (`Shard._snapshot`) as numpy
arrays made once (`Shard._table_views`): once the tables move to a copy (they changed
while a lent reply was still being read), the next reply lends the copy."""
from __future__ import annotations

import numpy as np
import pytest

from psgd import wire
from psgd.config import Config
from psgd.shard import Shard

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_read_after_the_tables_moved_to_a_copy_lends_the_copy(mode):
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": 1, "cluster.servers": 1})
    shard = Shard(cfg, 0)
    shard.in_flight = lambda: True   # every reply still being read: each change moves the tables
    tables = []
    for clock in range(3):
        g = np.full(shard.P, 0.01 * (clock + 1), np.float32)
        frames = wire.encode("push", id=clock + 1, rank=0, clock=clock, read_version=clock, pull=True,
                             arrays=[g, np.zeros(shard.B, np.float32)])
        (_, reply), = shard.handle("w", wire.decode(frames))
        shard.sent()
        tables.append(wire.decode(reply).arrays[0])
        now = shard.params.detach().numpy()
        np.testing.assert_array_equal(tables[-1], now)      # the tables as they are now
        assert np.shares_memory(tables[-1], now)             # lent, not copied
    assert not np.array_equal(tables[0], tables[1]) and not np.array_equal(tables[1], tables[2])
