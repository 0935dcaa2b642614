"""The replay/serve processes' malloc tuning: applied on glibc, a harmless no-op elsewhere."""

import platform

import pytest

from gpufleet.server import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_glibc_accepts_the_thresholds():
    assert allocator.tune_malloc() is True


def test_without_mallopt_nothing_is_changed(monkeypatch):
    class NoMallopt:
        def __init__(self, _name):
            pass

    monkeypatch.setattr(allocator.ctypes, "CDLL", NoMallopt)  # e.g. macOS, musl: no such symbol
    assert allocator.tune_malloc() is False
