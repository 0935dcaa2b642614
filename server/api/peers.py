"""The whole fleet's view from any shard (`--shard.peers`, `?scope=fleet`): ask every peer for its own part,
each within a short timeout, and put the parts together, saying which shards are missing.

A peer answers with its own part only (the request says `scope=shard`), so asking never recurses. Peers are
the shards' URLs, or `dns+URL` for a headless Service name that resolves to every replica's address (as
Thanos spells it). Two replicas of one shard (an HA pair) answer the same part: the first answer for each shard
index is kept. A peer that gives COUNT other than this server's is refused, named in the answer: its part would
overlap another's.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable, Mapping, Sequence, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
from pydantic import ValidationError

from gpufleet.server.api.models import PeerErrorModel, ShardedModel, ShardModel
from gpufleet.server.shard import Shard

Part = TypeVar("Part", bound=ShardedModel)


async def _resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Peers:
    """The other shards of this server's fleet, asked for their parts of an answer."""

    def __init__(
        self,
        urls: Sequence[str],
        shard: Shard,
        *,
        timeout_seconds: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
        resolve: Callable[[str, int], Any] = _resolve,
    ) -> None:
        self.urls = tuple(urls)
        self.shard = shard
        self.timeout_seconds = timeout_seconds
        self._transport = transport
        self._resolve = resolve

    async def _addresses(self) -> tuple[list[str], list[PeerErrorModel]]:
        """The URLs to ask: listed ones as they are, `dns+` ones once per address their name resolves to."""
        out: list[str] = []
        errors: list[PeerErrorModel] = []
        for url in self.urls:
            if not url.startswith("dns+"):
                out.append(url)
                continue
            parts = urlsplit(url[4:])
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                addresses = await asyncio.wait_for(self._resolve(parts.hostname or "", port), self.timeout_seconds)
            except (OSError, asyncio.TimeoutError) as exc:
                errors.append(PeerErrorModel(peer=url, error=f"cannot resolve: {exc or 'timeout'}"))
                continue
            for address in addresses:
                host = f"[{address}]" if ":" in address else address
                out.append(urlunsplit((parts.scheme, f"{host}:{port}", parts.path, "", "")))
        return out, errors

    async def fleet(
        self, own: Part, path: str, params: Mapping[str, Any], model: type[Part], merge: Callable[[list[Part]], Part]
    ) -> Part:
        """`own` part and every peer's answer to GET `path` with `params`, merged by `merge` (given the parts
        in shard order) and labelled with the shards missing and the peers that failed."""
        urls, errors = await self._addresses()
        parts: dict[int, Part] = {own.shard.index: own}
        async with httpx.AsyncClient(transport=self._transport, timeout=self.timeout_seconds) as client:
            answers = await asyncio.gather(*(self._ask(client, url, path, params, model) for url in urls))
        for url, answer in zip(urls, answers):
            if isinstance(answer, PeerErrorModel):
                errors.append(answer)
            elif answer.shard.count != self.shard.count:
                errors.append(
                    PeerErrorModel(
                        peer=url, error=f"is shard {answer.shard.index}/{answer.shard.count}, not of {self.shard.count}"
                    )
                )
            else:
                parts.setdefault(answer.shard.index, answer)
        merged = merge([parts[i] for i in sorted(parts)])
        return merged.model_copy(
            update={
                "shard": ShardModel(index=self.shard.index, count=self.shard.count),
                "scope": "fleet",
                "shards_missing": [i for i in range(self.shard.count) if i not in parts],
                "peer_errors": errors,
            }
        )

    async def _ask(
        self, client: httpx.AsyncClient, url: str, path: str, params: Mapping[str, Any], model: type[Part]
    ) -> Part | PeerErrorModel:
        """One peer's own part, or what went wrong (within the timeout: a slow peer must not hold the page)."""
        try:
            async with asyncio.timeout(self.timeout_seconds):
                response = await client.get(url + path, params={**params, "scope": "shard"})
            if response.status_code != 200:
                return PeerErrorModel(peer=url, error=f"HTTP {response.status_code}")
            return model.model_validate_json(response.content)
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            return PeerErrorModel(
                peer=url, error=f"{exc.__class__.__name__}: {exc}"[:200] if str(exc) else exc.__class__.__name__
            )
        except ValidationError as exc:
            return PeerErrorModel(peer=url, error=f"not a gpufleet server's answer: {exc.error_count()} error(s)")


def own_shard(shard: Shard) -> ShardModel:
    """The model of this server's shard, for its own answers."""
    return ShardModel(index=shard.index, count=shard.count)
