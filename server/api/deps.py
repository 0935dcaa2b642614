"""Request dependencies: the runtime the app was built around."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Depends, Request

from gpufleet.server.api.peers import Peers
from gpufleet.server.runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    """The Runtime handed to create_app."""
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_peers(request: Request) -> Peers | None:
    """The other shards (--shard.peers), None where there are none."""
    return getattr(request.app.state, "peers", None)


PeersDep = Annotated[Peers | None, Depends(get_peers)]
# Own part (the default) or the whole fleet's, from every peer shard (with --shard.peers).
Scope = Literal["shard", "fleet"]
