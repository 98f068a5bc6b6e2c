"""Optimizer keys at their edges (session 30's hunt)."""
import pytest

from psgd.config import ConfigError, load

pytestmark = pytest.mark.unit


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sets", [["optimizer.nesterov=true", "optimizer.momentum=0"],
                                  ["optimizer.nesterov=true", "optimizer.name=adam"],
                                  ["optimizer.nesterov=true", "optimizer.name=adamw", "optimizer.momentum=0"]])
def test_nesterov_that_would_be_dropped_is_refused(sets):
    """nesterov = true was dropped without a word where it cannot apply (SGD without
    momentum, Adam): the run was plain SGD or Adam, labelled nesterov in its config."""
    with pytest.raises(ConfigError, match="optimizer.nesterov = true .* set optimizer.nesterov = false"):
        load(None, sets, env={})


@pytest.mark.timeout(30)
def test_nesterov_with_momentum_is_taken():
    cfg = load(None, ["optimizer.nesterov=true", "optimizer.momentum=0.5"], env={})
    assert cfg.optimizer.nesterov and cfg.optimizer.momentum == 0.5
