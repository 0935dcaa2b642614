"""Fixtures shared by every test package."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def restore_logging():
    """main() points the root logger at stderr with its own level; put the test harness's back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
