"""Structured logs: one JSON object per line with the caller's context, or text for humans."""

from __future__ import annotations

import io
import logging

import orjson
import pytest

from gpufleet.logs import configure_logging


@pytest.fixture
def logged():
    """Records through the daemons' own logging set-up, as written to their stream."""
    stream = io.StringIO()
    root = logging.getLogger()
    before = (root.handlers[:], root.level)
    yield lambda fmt: (configure_logging("info", fmt, stream=stream), stream)[1]
    root.handlers[:], root.level = before


def test_json_lines_carry_the_context_and_not_uvicorns_coloured_copy(logged):
    stream = logged("json")
    # As uvicorn logs it: the same message again with terminal colour codes, in `extra`.
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]", 42, extra={"color_message": "Started server process [\x1b[36m%d\x1b[0m]"}
    )
    logging.getLogger("gpufleet.server.serve").warning("cannot pull", extra={"target": "dgx-01:9471", "attempt": 3})
    first, second = map(orjson.loads, stream.getvalue().splitlines())
    assert set(first) == {"ts", "level", "logger", "msg"} and first["msg"] == "Started server process [42]"
    assert (second["level"], second["target"], second["attempt"]) == ("warning", "dgx-01:9471", 3)


def test_text_lines_carry_the_context_and_not_uvicorns_coloured_copy(logged):
    stream = logged("text")
    logging.getLogger("uvicorn.error").info("Started", extra={"color_message": "\x1b[36mStarted\x1b[0m"})
    logging.getLogger("gpufleet.server.serve").warning("cannot pull", extra={"target": "dgx-01:9471"})
    first, second = stream.getvalue().splitlines()
    assert first.endswith("info    uvicorn.error: Started")
    assert second.endswith("warning gpufleet.server.serve: cannot pull target=dgx-01:9471")
