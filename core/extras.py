"""Which optional extra an installed command lacks, worded as one line that says how to install it.

One distribution carries both programs; a node installs it with the `agent` extra, a server host with
`server`. A command started from an install without its extra says so at once, instead of a traceback
from deep inside an import.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

from gpufleet import __version__

# The import name each extra's distributions provide, and the distribution to name in the message.
AGENT_MODULES = (("pynvml", "nvidia-ml-py"), ("grpc", "grpcio"), ("google.protobuf", "protobuf"))
SERVER_MODULES = (
    ("fastapi", "fastapi"),
    ("uvicorn", "uvicorn"),
    ("httpx", "httpx"),
    ("numpy", "numpy"),
    ("pydantic", "pydantic"),
    ("msgspec", "msgspec"),
)


def missing_extra(extra: str, modules: Sequence[tuple[str, str]]) -> str | None:
    """None when every module of `extra` can be imported, else the one-line message naming the extra."""
    for module, distribution in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return (
                f"{distribution} is missing: install gpufleet with the {extra} extra, from a built wheel "
                f"(pip install '{wheel_name()}[{extra}]') or in the clone (pip install '.[{extra}]'); "
                "see README.md"
            )
    return None


def wheel_name() -> str:
    """The file `python -m build --wheel` writes for this version (a glob would not expand inside quotes)."""
    return f"gpufleet-{__version__}-py3-none-any.whl"
