"""Request dependencies: the runtime the app was built around."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gpufleet.server.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    """The Runtime handed to create_app."""
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
