"""Who may talk to the server: the Host and Origin allow-lists and the API key, checked before any route runs, and
a header timeout for the connections themselves.

Host: a browser page from elsewhere can reach a server on 127.0.0.1 by DNS rebinding (attacker.example resolves
to 127.0.0.1, the page's requests then carry "Host: attacker.example"), so only the loopback names and the ones
the operator allows are answered, as Jupyter does. Origin: a browser says which page sent a request; a page from
another site may not drive this one (a POST needs no CORS preflight when it is plain enough). API key: as vLLM's
--api-key middleware, one "Authorization: Bearer KEY" header, compared in constant time; every path needs it
but /health, the lab's static files (they hold no data) and, with --metrics-public, /metrics.
"""
from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
HEADER_TIMEOUT = 10.0         # seconds a connection may take to send a request's headers (slowloris)


def host_name(value: str) -> str:
    """A Host header or Origin's host without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "::1"."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """Pure ASGI middleware: 403 for a Host or Origin outside the allow-list, 401 without the one right key."""

    def __init__(self, app, api_key: str | None = None, allowed_hosts=(), public_paths=("/health",),
                 public_prefixes=()):
        self.app = app
        self.key_digest = None if api_key is None else hashlib.sha256(b"Bearer " + api_key.encode()).digest()
        names = [h.strip().lower() for h in allowed_hosts if h.strip()]
        self.any_host = "*" in names
        self.hosts = set(LOOPBACK_NAMES) | {host_name(h) for h in names}
        self.public_paths, self.public_prefixes = set(public_paths), tuple(public_prefixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self.check(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> APIError | None:
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), []).append(value)
        hosts = headers.get(b"host", [])
        if len(hosts) != 1:
            return APIError(400, "send exactly one Host header")
        host = hosts[0].decode("latin-1")
        if not self.allowed(host_name(host)):
            return APIError(403, f"Host {host[:64]!r} is not allowed: this server answers the loopback names and "
                                 f"those of --allowed-hosts (start it with --allowed-hosts NAME to add one)")
        origins = headers.get(b"origin", [])
        if len(origins) > 1:
            return APIError(400, "send at most one Origin header")
        if origins:
            origin = origins[0].decode("latin-1")
            try:
                name = urlsplit(origin).hostname
            except ValueError:
                name = None
            if name is None or not self.allowed(name):
                return APIError(403, f"requests from pages of {origin[:64]!r} are not allowed: this server answers "
                                     f"pages of the loopback names and of --allowed-hosts")
        path = scope["path"]
        if self.key_digest is None or path in self.public_paths or path.startswith(self.public_prefixes):
            return None
        keys = headers.get(b"authorization", [])
        if len(keys) > 1:
            return APIError(401, "send one Authorization header, not several")
        given = keys[0] if keys else b""
        # Digests of equal length, compared in constant time: the time taken says nothing about the key.
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self.key_digest):
            return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")
        return None

    def allowed(self, name: str) -> bool:
        return self.any_host or name in self.hosts


class HeaderTimeout(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for request headers: a connection that has not sent a whole
    request head within HEADER_TIMEOUT seconds of connecting (or of its previous response) is closed, so a client
    that opens sockets and trickles bytes (slowloris) cannot hold them; uvicorn's own keep-alive timer stops at
    the first byte. With --max-connections (uvicorn's limit_concurrency) it bounds what idle sockets can take."""

    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():   # no whole request head yet
            self.transport.close()
