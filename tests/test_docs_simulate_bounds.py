"""README's "Simulating at scale" and docs/simulation.md against psgd simulate's checks:
the cost model's bounds (refused before anything runs) and the keys it warns that a
simulation never reads, so that neither can change in the code and not in the docs."""
from __future__ import annotations

import os
import re

import pytest

from psgd.config import MAX_DELAY_S
from psgd.simulate import MEANINGLESS, MIN_GBPS

pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(__file__), "..")


def texts() -> dict[str, str]:
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("### Simulating at scale"):readme.index("## Configuration")]
    return {"README.md": " ".join(section.split()),
            "docs/simulation.md": " ".join(open(os.path.join(ROOT, "docs", "simulation.md")).read().split())}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("doc", ["README.md", "docs/simulation.md"])
def test_the_docs_give_the_cost_models_bounds_and_the_keys_a_simulation_never_reads(doc):
    """Neither said that psgd simulate refuses sim.compute_s or sim.latency_s above 1e6 s and
    a bandwidth below 1e-12 Gbit/s, nor that it warns of faults that slow no worker and of
    --set keys that nothing in a simulation reads."""
    text = texts()[doc]
    at_most = re.search(r"`sim\.compute_s` and `sim\.latency_s`(?: must be)? at most ([0-9.e+-]+) s", text)
    at_least = re.search(r"`sim\.bandwidth_gbps` and `sim\.apply_gbps`(?: must be)? at least ([0-9.e+-]+) Gbit/s",
                         text)
    assert at_most and float(at_most.group(1)) == MAX_DELAY_S, f"{doc} does not give sim.compute_s's bound"
    assert at_least and float(at_least.group(1)) == MIN_GBPS, f"{doc} does not give the bandwidths' bound"
    for key, _ in MEANINGLESS:
        assert f"`{key}*`" in text if key.endswith(".") else f"`{key}`" in text, f"{doc} does not name {key}"
    assert "slows no worker" in text, f"{doc} does not say that a fault that slows no worker is warned of"
