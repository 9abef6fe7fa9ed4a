"""What ``mlx-dspark serve`` checks before a request reaches a route (docs/serve.md, "Exposure").

A web page in a browser can send requests to a server on localhost: a cross-site ``text/plain``
POST needs no preflight, and DNS rebinding makes a foreign name resolve to 127.0.0.1. So a
request must name this server in ``Host`` (localhost names, the bound address, names given
with ``--allow-host``), a browser's ``Origin`` must be allowed (``--allow-origin``, which also
answers CORS preflights), and a POST must be ``application/json``. The body is read here up to
``--max-request-mb`` and refused with 413 past it, so no request holds more than that much.

An ASGI middleware; refusals are error objects in the protocol of the route asked for
(errors.py)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from . import errors
from .errors import ApiError

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


@dataclass(frozen=True)
class Exposure:
    """Who may reach the server: ``bound`` is the listening address; ``hosts`` more names
    for ``Host``; ``origins`` browser origins allowed (``"*"``: any); ``max_body`` bytes."""

    bound: str = "127.0.0.1"
    hosts: frozenset = field(default_factory=frozenset)
    origins: frozenset = field(default_factory=frozenset)
    max_body: int = 8 << 20

    def host_allowed(self, host: str) -> bool:
        """``host``: the Host header, port included. Any IP address is allowed when the
        server listens on every address (an address is not a DNS name to rebind)."""
        name = _host_name(host)
        if name in LOCAL_HOSTS or name in self.hosts or name == self.bound.lower():
            return True
        if self.bound in WILDCARDS:
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.rstrip("/") in self.origins


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):                       # [::1]:8080
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HttpGuard:
    """ASGI middleware enforcing an :class:`Exposure` on every HTTP request."""

    def __init__(self, app, exposure: Exposure):
        self.app, self.exposure = app, exposure

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            cors = self._check(scope, headers)
            if scope["method"] == "OPTIONS" and cors:
                return await _preflight(cors, send)
            if scope["method"] == "POST":
                receive = await self._body(headers, receive)
        except ApiError as e:
            return await errors.response(e, scope.get("path", ""),
                                         cors_origin(headers, self.exposure))(
                scope, receive, send)
        if cors:
            send = _with_cors(send, cors)
        await self.app(scope, receive, send)

    def _check(self, scope, headers) -> str | None:
        """Refuse a request this server must not answer; the origin to allow, if any."""
        if not self.exposure.host_allowed(headers.get("host", "")):
            raise ApiError(f"Host '{headers.get('host', '')[:100]}' does not name this server "
                           f"(serve --allow-host NAME to accept it)", status=403,
                           code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.exposure.origin_allowed(origin):
            raise ApiError(f"requests from the web origin '{origin[:100]}' are refused "
                           f"(serve --allow-origin ORIGIN to allow one)", status=403,
                           code="origin_not_allowed")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise ApiError(f"the request body must be sent as 'Content-Type: "
                               f"application/json', not '{kind[:60]}'", status=415,
                               code="unsupported_media_type")
        return origin

    async def _body(self, headers, receive):
        """Read the body (at most ``max_body`` bytes, else 413) and hand back a ``receive``
        that gives it to the app, then whatever the connection says next (a disconnect)."""
        limit = self.exposure.max_body
        too_big = ApiError(f"the request body is larger than the server's limit of "
                           f"{limit / (1 << 20):g} MB (serve --max-request-mb)", status=413,
                           code="request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError("the client went away", status=400)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def cors_origin(headers: dict, exposure: Exposure) -> str | None:
    origin = headers.get("origin")
    return origin if origin is not None and exposure.origin_allowed(origin) else None


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _preflight(origin: str, send):
    await send({"type": "http.response.start", "status": 204, "headers": _cors_headers(origin) + [
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", b"Authorization, Content-Type"),
        (b"access-control-max-age", b"600")]})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(send, origin: str):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              *_cors_headers(origin)]}
        await send(message)
    return sending
