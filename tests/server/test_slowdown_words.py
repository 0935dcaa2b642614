"""Two slowdown figures, each named for what it measures: a straggler alert's is the slowdown put down to its
culprit as the alert fired; a job's (in /jobs, `status` and the status page) is the job now against its own
baseline. At one moment they may differ; their words must say which is which."""

from __future__ import annotations

import math
import re

from gpufleet.server.alerts import AlertKind, AlertState
from gpufleet.server.api.models import JobModel
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig
from gpufleet.server.status import render
from tests.server.engine_samples import T0, cluster_lines
from tests.server.test_engine_straggler import _slow_gpu

CULPRIT_FIGURE = re.compile(r"\. Job j1 loses ~(\d+) % per step to it \(estimated as it fired\)")


def test_the_straggler_summary_and_the_job_each_name_their_own_figure() -> None:
    engine = Engine(EngineConfig.from_mapping(None))
    step = engine.config.tick_seconds
    boundary = None
    for sample in sorted((parse_line(line) for line in cluster_lines(520, override=_slow_gpu)), key=lambda s: s.time):
        if boundary is not None and sample.time >= boundary:
            engine.advance(boundary)
        boundary = (math.floor(sample.time / step) + 1) * step
        engine.ingest(sample)
    engine.advance(boundary)
    (alert,) = [a for a in engine.alerts() if a.kind == AlertKind.STRAGGLER and a.state is AlertState.FIRING]
    assert alert.started is not None and alert.started < T0 + 520
    found = CULPRIT_FIGURE.search(alert.summary)
    assert found, alert.summary
    # The summary's figure is the evidence's, to the percent.
    assert abs(int(found.group(1)) - alert.evidence["estimated_job_slowdown_ratio"] * 100) <= 0.5 + 1e-9
    (job,) = [j for j in engine.jobs() if j.hpc_job == "j1"]
    assert job.estimated_slowdown_ratio is not None and job.baseline_sm_active_ratio is not None

    # The job's figure says it is the job now against its own baseline, and that the alert's is another one.
    described = JobModel.model_fields["estimated_slowdown_ratio"].description or ""
    assert "now" in described and "own baseline" in described and "'loses ~N % per step'" in described
    header = render(
        {"evaluated_at": T0, "jobs": [job.to_dict()]}, {"total": 0, "alerts": []}, {"nodes": [], "targets": []}, url="u"
    ).splitlines()[2]
    assert "SLOWER-VS-BASELINE" in header.split()
