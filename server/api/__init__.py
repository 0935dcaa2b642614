"""The server's HTTP API: an app factory and one router per resource."""

from gpufleet.server.api.app import create_app

__all__ = ["create_app"]
