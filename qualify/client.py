"""HTTP client for the engine protocol (docs/PROTOCOL.md): typed requests and replies, one-line errors.

The harness speaks only this to an engine, local or in a container; it never imports the engine. A
sandboxed local engine serves in a network namespace of its own: the client then makes each connection's
socket there (qualify/netns.py), so the engine needs no address the host can reach.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpcore
import httpx
from pydantic import BaseModel, ValidationError

from qualify.netns import Netns, NetnsError
from qualify.protocol import (
    CaptureResponse,
    CompletionRequest,
    CompletionResponse,
    Describe,
    ErrorBody,
    Health,
    KvDigest,
    KvEchoRequest,
    KvFillRequest,
    KvHandles,
    ProbeResponse,
    ReloadRequest,
    ReloadResponse,
    SessionClosed,
    SessionStartRequest,
    SessionState,
    SessionStepRequest,
)

M = TypeVar("M", bound=BaseModel)
NetnsOf = Callable[[], "Netns | None"]  # the engine's network namespace now (None: the host's)


class _NetnsBackend(httpcore.SyncBackend):
    """TCP connections made inside the engine's network namespace (when it has one of its own)."""

    def __init__(self, netns: NetnsOf) -> None:
        self._netns = netns

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):  # type: ignore[no-untyped-def]
        ns = self._netns()
        if ns is None:
            return super().connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            with ns.entered():
                return super().connect_tcp(host, port, timeout, local_address, socket_options)
        except NetnsError as exc:  # httpx makes it a ConnectError, as the client expects of a lost engine
            raise httpcore.ConnectError(f"cannot enter the engine's network namespace: {exc}") from exc


def _transport(netns: NetnsOf) -> httpx.HTTPTransport:
    """httpx's own transport (its error mapping, its pool's limits) over a pool whose sockets are made in
    the engine's namespace; tests/harness/test_netns.py holds this to real namespaces."""
    t = httpx.HTTPTransport(trust_env=False)
    t._pool = httpcore.ConnectionPool(network_backend=_NetnsBackend(netns))  # where httpx keeps its pool
    return t


class EngineError(Exception):
    """The engine answered with an error body (4xx/5xx): its type and message, and the HTTP status."""

    def __init__(self, status: int, type_: str, message: str, path: str) -> None:
        super().__init__(f"{path} answered {status} {type_}: {message}")
        self.status, self.type, self.message, self.path = status, type_, message, path


class EngineUnreachable(Exception):
    """No answer: connection refused or reset (the engine died or restarted), or a timeout."""

    def __init__(self, message: str, path: str, timed_out: bool) -> None:
        super().__init__(message)
        self.path, self.timed_out = path, timed_out


_SESSION_PATH = re.compile(r"/qualify/sessions/[^/]+/")
MAX_WAITED_KEYS = 32


class EngineClient:
    """One engine's API. `base_url` is a callable so a restarted container's new port is followed;
    `netns` (a callable, as a restarted engine has a new one) names the engine's network namespace."""

    def __init__(
        self, base_url: Callable[[], str] | str, timeout_s: float = 30.0, netns: NetnsOf | None = None
    ) -> None:
        self._base = base_url if callable(base_url) else (lambda: base_url)
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # monotonic; requests never wait past it
        # "METHOD path" -> [requests, seconds waited]: where a check's time goes (the pipeline takes it)
        self.waited: dict[str, list[float]] = {}
        if netns is None:
            self._http = httpx.Client(timeout=timeout_s)
        else:
            self._http = httpx.Client(timeout=timeout_s, transport=_transport(netns))

    def close(self) -> None:
        self._http.close()

    def take_waited(self) -> dict[str, dict[str, float]]:
        """The time waited per endpoint since the last call ({"n": requests, "s": seconds}), reset."""
        out = {k: {"n": int(n), "s": round(s, 3)} for k, (n, s) in sorted(self.waited.items())}
        self.waited = {}
        return out

    def _timeout(self, timeout_s: float | None) -> float:
        t = timeout_s if timeout_s is not None else self.timeout_s
        if self.deadline is not None:
            t = min(t, max(0.05, self.deadline - time.monotonic()))
        return t

    def _request(
        self, method: str, path: str, body: BaseModel | None = None, timeout_s: float | None = None
    ) -> httpx.Response:
        t = self._timeout(timeout_s)
        started = time.monotonic()
        try:
            r = self._http.request(
                method,
                self._base() + path,
                json=None if body is None else body.model_dump(mode="json", exclude_none=True),
                timeout=httpx.Timeout(t, connect=min(t, 5.0)),
            )
        except httpx.TimeoutException as exc:
            raise EngineUnreachable(f"{method} {path} got no answer within {t:.1f} s", path, True) from exc
        except httpx.TransportError as exc:
            raise EngineUnreachable(
                f"{method} {path} failed: {type(exc).__name__}: {exc}", path, False
            ) from exc
        finally:
            key = f"{method} {_SESSION_PATH.sub('/qualify/sessions/{id}/', path.split('?')[0])}"
            if key not in self.waited and len(self.waited) >= MAX_WAITED_KEYS:
                key = "other"  # a bounded record, whatever paths a caller sends
            got = self.waited.setdefault(key, [0, 0.0])
            got[0] += 1
            got[1] += time.monotonic() - started
        if r.status_code >= 400:
            try:
                err = ErrorBody.model_validate(r.json()).error
                raise EngineError(r.status_code, err.type, err.message, path)
            except (ValueError, ValidationError):
                raise EngineError(r.status_code, "HTTPError", r.text[:300], path) from None
        return r

    def _typed(self, model: type[M], r: httpx.Response, path: str) -> M:
        try:
            return model.model_validate(r.json())
        except (ValueError, ValidationError) as exc:
            raise EngineError(
                r.status_code,
                "ProtocolError",
                f"reply is not a valid {model.__name__}: {str(exc).splitlines()[0]}",
                path,
            ) from exc

    def _get(self, model: type[M], path: str, timeout_s: float | None = None) -> M:
        return self._typed(model, self._request("GET", path, timeout_s=timeout_s), path)

    def _post(
        self, model: type[M], path: str, body: BaseModel | None = None, timeout_s: float | None = None
    ) -> M:
        return self._typed(model, self._request("POST", path, body, timeout_s), path)

    # ------------------------------------------------------------ endpoints
    def health(self, timeout_s: float | None = 5.0) -> Health:
        return self._get(Health, "/health", timeout_s)

    def describe(self) -> Describe:
        return self._get(Describe, "/v1/describe")

    def complete(self, request: CompletionRequest, timeout_s: float | None = None) -> CompletionResponse:
        return self._post(CompletionResponse, "/v1/completions", request, timeout_s)

    def capture(self, timeout_s: float | None = None) -> CaptureResponse:
        return self._post(CaptureResponse, "/qualify/capture", None, timeout_s)

    def reload(self, request: ReloadRequest, timeout_s: float | None = None) -> ReloadResponse:
        return self._post(ReloadResponse, "/qualify/reload", request, timeout_s)

    def probe(self, timeout_s: float | None = None) -> ProbeResponse:
        return self._post(ProbeResponse, "/qualify/probe", None, timeout_s)

    def kv_handles(self, timeout_s: float | None = None) -> KvHandles:
        return self._get(KvHandles, "/qualify/kv-handles", timeout_s)

    def kv_fill(self, request: KvFillRequest, timeout_s: float | None = None) -> KvDigest:
        return self._post(KvDigest, "/qualify/kv-fill", request, timeout_s)

    def kv_echo(self, request: KvEchoRequest, timeout_s: float | None = None) -> KvDigest:
        return self._post(KvDigest, "/qualify/kv-echo", request, timeout_s)

    def session_start(self, request: SessionStartRequest, timeout_s: float | None = None) -> SessionState:
        return self._post(SessionState, "/qualify/sessions", request, timeout_s)

    def session_step(
        self, session: str, request: SessionStepRequest, timeout_s: float | None = None
    ) -> SessionState:
        return self._post(SessionState, f"/qualify/sessions/{session}/step", request, timeout_s)

    def session_close(self, session: str, timeout_s: float | None = None) -> SessionClosed:
        return self._post(SessionClosed, f"/qualify/sessions/{session}/close", None, timeout_s)

    def metrics(self) -> dict[str, float]:
        """Prometheus text as {name{labels}: value}."""
        return parse_prometheus(self._request("GET", "/metrics").text)

    def raw(self, method: str, path: str, json: Any = None) -> httpx.Response:
        """An untyped request (tests, probing refusals)."""
        return self._http.request(method, self._base() + path, json=json, timeout=self._timeout(None))


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out
