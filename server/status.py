"""`gpufleet-server status`: what a running server sees now, for a terminal.

Each job against its own baseline (slowed, communication- or input-bound, who holds it back) and the
alerts firing, read from the server's REST API. The day gpufleet is installed that answer is one
command away, before any dashboard is imported. Exit 0 once printed; 1 when the server cannot be read;
2 for bad flags.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from typing import Any, Sequence

import httpx

from gpufleet.server.outbound import Outbound
from gpufleet.server.settings import ClientAuth, client_flags, parse_url

_PREFIX = "api"


def render(jobs: dict[str, Any], alerts: dict[str, Any], nodes: dict[str, Any], url: str) -> str:
    """The report for the /jobs, /alerts?state=firing and /nodes documents of one server."""
    targets = nodes.get("targets") or []
    now = jobs.get("evaluated_at")
    when = "not evaluated yet" if now is None else f"evaluated at {_clock(now)}"
    lines = [
        f"gpufleet-server {url}: {sum(t['up'] for t in targets)} of {len(targets)} agents up, "
        f"{len(nodes.get('nodes') or [])} nodes, {when}",
        "",
    ]
    rows = [("JOB", "GPUS", "NODES", "UTIL", "SM", "BASELINE", "SLOWER-VS-BASELINE", "LOST(GPU-H)", "NOW")]
    for job in sorted(jobs.get("jobs") or [], key=lambda j: str(j.get("hpc_job"))):
        rows.append(
            (
                str(job.get("hpc_job")),
                str(job.get("gpus") or 0),
                str(len(job.get("nodes") or [])),
                _ratio(job.get("utilization_ratio")),
                _ratio(job.get("sm_active_ratio")),
                _ratio(job.get("baseline_sm_active_ratio")),
                _percent(job.get("estimated_slowdown_ratio")),
                _hours(job.get("gpu_hours_lost")),
                _state(job),
            )
        )
    lines += _table(rows) if len(rows) > 1 else ["no job attributed yet"]
    firing = alerts.get("alerts") or []
    lines += ["", f"FIRING ({alerts.get('total', len(firing))})" if firing else "nothing firing"]
    heads = _table(
        [
            (a["severity"], a["kind"], _subject(a), a.get("hpc_job") or "-", _since(a.get("started"), now))
            for a in firing
        ]
    )
    # The summary whole, on a line of its own: the why comes at its end.
    for head, alert in zip(heads, firing):
        lines += [head, "    " + alert["summary"]]
    return "\n".join(lines)


def _state(job: dict[str, Any]) -> str:
    """What holds a job back now, in a few words."""
    parts = [f"straggler {_subject(s)}" for s in job.get("stragglers") or []]
    if job.get("comm_bound"):
        parts.append("comm_bound")
    if job.get("input_bound"):
        parts.append("input_bound")
    return ", ".join(parts) or "ok"


def _subject(a: dict[str, Any]) -> str:
    if a.get("node") is None:
        return "-"
    return a["node"] if a.get("gpu") is None else f"{a['node']}/{a['gpu']}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    # Rounded as an int: a job a hair faster than its baseline reads "0 %", not "-0 %".
    return "-" if value is None else f"{round(value * 100)} %"


def _hours(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _since(started: float | None, now: float | None) -> str:
    """How long an alert has fired, in the engine's own (sample) time."""
    if started is None or now is None:
        return "-"
    seconds = max(int(now - started), 0)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns, the last one as long as it is."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufleet-server status", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default="http://127.0.0.1:9472", help="the server's API (default http://127.0.0.1:9472)"
    )
    parser.add_argument(
        "--timeout", default="10", metavar="SECONDS", help="give up on a request after this long (default 10)"
    )
    for flag, (dest, _, doc) in _CLIENT_FLAGS.items():
        parser.add_argument(f"--{flag}", dest=dest, metavar="VALUE", help=doc)
    return parser


_CLIENT_FLAGS = client_flags(_PREFIX, _PREFIX, "the server's API", bearer=False)


def main(argv: Sequence[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """CLI entry point (transport: for tests)."""
    args = vars(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    try:
        url, timeout, peer = _settings(args)
    except ValueError as exc:
        print(f"gpufleet-server status: {exc}", file=sys.stderr)
        return 2
    try:
        with httpx.Client(
            base_url=url, timeout=timeout, verify=peer.ssl_context, auth=peer.auth, transport=transport
        ) as client:
            jobs, alerts, nodes = (
                _get(client, path, params)
                for path, params in (("/jobs", {}), ("/alerts", {"state": "firing", "limit": 1000}), ("/nodes", {}))
            )
    except (httpx.HTTPError, ValueError) as exc:
        print(f"gpufleet-server status: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    print(render(jobs, alerts, nodes, url=url))
    return 0


def _settings(args: dict[str, Any]) -> tuple[str, float, Outbound]:
    """The URL, the timeout and the client credentials; ValueError naming the flag at fault."""

    def parsed(flag: str, parse, value):
        try:
            return parse(value)
        except ValueError as exc:
            raise ValueError(f"--{flag}: {exc}") from None

    url = parsed("url", parse_url, args["url"])
    timeout = parsed("timeout", float, args["timeout"])
    if not timeout > 0:
        raise ValueError("--timeout: must be above 0")
    fields = {
        dest.split(".", 1)[1]: parsed(flag, parse, args[dest])
        for flag, (dest, parse, _) in _CLIENT_FLAGS.items()
        if args[dest] is not None
    }
    auth = ClientAuth(**fields)
    problem = auth.problem(_PREFIX)
    if problem:
        raise ValueError(problem)
    if auth.uses_tls() and not url.startswith("https://"):
        raise ValueError(f"{_PREFIX}.tls.* settings mean nothing over http: use an https:// --url")
    return url, timeout, Outbound(auth, _PREFIX)


def _get(client: httpx.Client, path: str, params: dict[str, Any]) -> dict[str, Any]:
    """One document of the API; ValueError with what went wrong, worded for an operator."""
    response = client.get(path, params=params)
    if response.status_code == 401:
        raise ValueError("the server wants credentials (--api.basic-auth.username and --api.basic-auth.password-file)")
    if response.status_code != 200:
        raise ValueError(f"{path} answered HTTP {response.status_code}")
    try:
        doc = response.json()
    except ValueError:
        raise ValueError(f"{path} did not answer JSON: is this a gpufleet-server?") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} did not answer a JSON object: is this a gpufleet-server?")
    return doc
