"""Every detector is called the same way: detect(tick, state, context)."""

from __future__ import annotations

import inspect

import pytest

from gpufleet.server.engine.detectors import Context, health, straggler, thermal, workload
from gpufleet.server.engine.tick import Tick


@pytest.mark.parametrize("detector", [thermal, health, straggler, workload], ids=lambda m: m.__name__)
def test_every_detector_takes_the_tick_its_state_and_the_context(detector):
    params = list(inspect.signature(detector.detect).parameters.values())
    assert [p.name for p in params] == ["tick", "state", "context"]
    assert all(p.default is inspect.Parameter.empty for p in params)
    hints = inspect.get_annotations(detector.detect, eval_str=True)
    assert hints["tick"] is Tick and hints["context"] is Context
