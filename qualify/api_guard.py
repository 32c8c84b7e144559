"""Guards in front of the API's routes: the bearer token checked before any body is read, a body size cap
(Content-Length or a streamed count, 413), bounded JSON parsing, and one-line 422s that never echo input."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from receipts.canonical import loads

_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


class BodyTooLarge(HTTPException):
    """A request body over the cap; an HTTPException so FastAPI's body reading passes it through as 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


def token_problem(token: str | None, authorization: str | None) -> str | None:
    """Why `authorization` does not carry the bearer `token` (None when it does)."""
    if token is None:
        return "decisions are disabled: start qualify serve with --token-file"
    scheme, _, given = (authorization or "").partition(" ")
    # compare_digest: the time taken does not tell how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        return "missing or wrong bearer token"
    return None


class RequestGuard:
    """ASGI middleware: on `protected` paths the token is checked from the headers alone (401 before a byte
    of the body is read); every body is capped at `limit` bytes, by Content-Length when given and by
    counting the chunks as they arrive otherwise (413, the rest is never read)."""

    def __init__(self, app: ASGIApp, *, limit: int, token: str | None, protected: frozenset[str]) -> None:
        self.app, self.limit, self.token, self.protected = app, limit, token, protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["path"] in self.protected:
            problem = token_problem(self.token, headers.get("authorization"))
            if problem is not None:
                answer = JSONResponse(
                    {"detail": problem}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await answer(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            status, detail = (
                (413, f"request body is larger than {self.limit} bytes")
                if length.isdigit()
                else (400, "Content-Length is not a number")
            )
            await JSONResponse({"detail": detail}, status_code=status)(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _counted(self, receive: Receive) -> Callable[[], Awaitable[Message]]:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        return counted


class _BoundedJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads(await self.body())
            except (ValueError, UnicodeDecodeError) as exc:
                line = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                raise HTTPException(422, f"request body is not acceptable JSON: {line}") from None
        return self._json


def _query_names(dependant: Any) -> set[str]:
    """The query parameter names a route's dependant declares, its sub-dependencies' included."""
    names = {p.alias for p in getattr(dependant, "query_params", ())}
    for sub in getattr(dependant, "dependencies", ()):
        names |= _query_names(sub)
    return names


class BoundedJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `receipts.canonical.loads`: NaN/Infinity, integers over 40
    digits and nesting deeper than canonical.MAX_DEPTH are a one-line 422, never a 500."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Any]]:
        handler = super().get_route_handler()
        # Query parameters the route declares (its dependencies' too): any other is refused, as the CLI
        # refuses an unknown option, instead of being ignored (a misspelt filter would widen the answer).
        known = sorted(_query_names(self.dependant))

        async def bounded(request: Request) -> Any:
            unknown = sorted(set(request.query_params) - set(known))
            if unknown:
                takes = f"it takes: {', '.join(known)}" if known else "it takes none"
                return JSONResponse(
                    {"detail": f"unknown query parameter {unknown[0][:40]!r} for {self.path}; {takes}"},
                    status_code=422,
                )
            return await handler(_BoundedJSONRequest(request.scope, request.receive))

        return bounded


def validation_problem(_: Request, exc: Exception) -> JSONResponse:
    """A 422 naming the first few bad fields in one line, without echoing the input (which may hold NaN or
    a huge value that cannot be written back as JSON)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    parts = []
    for error in errors[:3]:
        loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {str(error.get('msg', 'invalid')).removeprefix('Value error, ')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    detail = "; ".join(parts) + more if parts else "invalid request"
    return JSONResponse({"detail": detail[:1000]}, status_code=422)
