"""The FastAPI app factory: routers, /metrics, and the runtime's lifespan."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from gpufleet.webconfig import WebConfig
from gpufleet.server.api import alerts, fleet, health, page
from gpufleet.server.api.auth import WebGuard
from gpufleet.server.api.peers import Peers
from gpufleet.server.metrics import build_registry
from gpufleet.server.runtime import Runtime
from gpufleet.server.settings import ServerSettings


def create_app(
    settings: ServerSettings, *, runtime: Runtime, run_pipeline: bool = True, web: WebConfig | None = None
) -> FastAPI:
    """An app serving `runtime`; with run_pipeline the lifespan starts and stops its pull loop; `web`: basic
    auth and headers from --web.config.file (TLS itself is the HTTP server's, see serve.uvicorn_server)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if run_pipeline:
            await runtime.start()
        try:
            yield
        finally:
            if run_pipeline:
                await runtime.stop()

    # /docs from the Swagger UI files fastapi-offline installs, served by this app: GPU clusters are often
    # air-gapped, and FastAPI's default page loads Swagger UI from a CDN.
    app = FastAPIOffline(
        docs_url="/docs",
        redoc_url=None,
        static_url="/docs/assets",
        title="gpufleet server",
        summary="Stragglers, thermal throttling and communication-bound drops in GPU training clusters.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.settings = settings
    app.state.peers = (
        Peers(settings.shard_peers, settings.shard, timeout_seconds=settings.shard_peer_timeout_seconds)
        if settings.shard_peers
        else None
    )
    registry = build_registry(runtime)
    app.include_router(alerts.router)
    app.include_router(fleet.router)
    app.include_router(health.router)
    app.include_router(page.router)

    @app.get(
        "/metrics",
        tags=["metrics"],
        summary="Prometheus exposition",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    )
    async def metrics() -> Response:
        """Active alerts, job health and the server's own ingest and engine health."""
        body = await run_in_threadpool(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if web is not None and (web.users or web.headers):
        app.add_middleware(WebGuard, auth=web.authenticator(), headers=web.headers)
    return app
