"""Fixtures shared by every test package."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def restore_logging():
    """main() points the root logger at stderr with its own level; put the test harness's back after every
    test, so no later test logs through a handler bound to an earlier test's captured (and closed) stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
