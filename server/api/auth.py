"""Basic auth and extra headers from `--web.config.file`, as pure ASGI middleware in front of every route."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import orjson
from starlette.concurrency import run_in_threadpool

from gpufleet.webconfig import OPEN_PATHS, BasicAuth

_UNAUTHORIZED = orjson.dumps({"detail": "valid basic auth credentials required"})


class WebGuard:
    """Answers 401 to requests without the configured credentials, and adds the configured headers."""

    def __init__(self, app: Callable[..., Any], auth: BasicAuth | None, headers: Mapping[str, str]) -> None:
        self.app = app
        self.auth = auth
        self.headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        reply = self._with_headers(send) if self.headers else send
        if self.auth is not None and scope["path"] not in OPEN_PATHS:
            given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            ok = self.auth.cached(given)
            if ok is None:
                # bcrypt runs tens of milliseconds for credentials not seen before: off the event loop.
                ok = await run_in_threadpool(self.auth.allows, given)
            if not ok:
                await reply(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                            (b"www-authenticate", b'Basic realm="gpufleet-server", charset="UTF-8"'),
                        ],
                    }
                )
                await reply({"type": "http.response.body", "body": _UNAUTHORIZED})
                return
        await self.app(scope, receive, reply)

    def _with_headers(self, send: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        return wrapped
