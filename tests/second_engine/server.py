"""The second engine's HTTP server, on the standard library: the routes of docs/PROTOCOL.md, requests
validated as the contract says (unknown fields refused with 422), every error as {"error": {type, message}}.
One lock serializes the engine's work; /health answers beside it."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .engine import COUNTERS, Engine, OverCapacity
from .model import BOS, DIMS

MAX_BODY = 4 << 20


class Invalid(Exception):
    """A request that does not fit the protocol's schema: 422 ValidationError."""


class Unavailable(Exception):
    """A mode this engine does not have: 409 ModeUnavailable."""


def _fields(body: object, allowed: set[str], required: set[str]) -> dict:
    if not isinstance(body, dict):
        raise Invalid("the body must be a JSON object")
    extra = set(body) - allowed
    if extra:
        raise Invalid(f"unknown field(s) {sorted(extra)}")
    missing = required - set(body)
    if missing:
        raise Invalid(f"missing field(s) {sorted(missing)}")
    return body


def _int(v: object, name: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise Invalid(f"{name} must be an integer in [{lo}, {hi if hi is not None else '...'}]")
    return v


def _ids(v: object, name: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise Invalid(f"{name} must be a non-empty list of token ids")
    return [_int(t, name, 0, DIMS["vocab"] - 1) for t in v]


def _prompts(p: object) -> list[list[int]]:
    if isinstance(p, str):
        return [[BOS, *p.encode()]]
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return [_ids(p, "prompt")]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return [[BOS, *x.encode()] for x in p]
    if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        return [_ids(x, "prompt") for x in p]
    raise Invalid("prompt must be text, token ids, or a non-empty batch of either")


def completions(engine: Engine, body: object) -> dict:
    b = _fields(body, {"prompt", "max_tokens", "mode", "speculative", "drafts"}, {"prompt", "max_tokens"})
    prompts = _prompts(b["prompt"])
    max_tokens = _int(b["max_tokens"], "max_tokens", 1)
    mode = b.get("mode", "auto")
    if mode not in ("auto", "eager", "graph"):
        raise Invalid("mode must be auto, eager or graph")
    if mode == "graph":
        raise Unavailable("mode graph: this engine captures no graphs; use auto or eager")
    spec = b.get("speculative", False)
    if not isinstance(spec, bool):
        raise Invalid("speculative must be true or false")
    drafts = b.get("drafts")
    if drafts is not None:
        if not spec or len(prompts) != 1:
            raise Invalid("drafts need speculative=true and a batch of one prompt")
        if not isinstance(drafts, list) or not 1 <= len(drafts) <= max_tokens:
            raise Invalid("drafts need between 1 and max_tokens verify steps")
        drafts = [_ids(r, "drafts") for r in drafts]
        if any(len(r) > 64 for r in drafts):
            raise Invalid("each verify step drafts 1 to 64 token ids")
    if spec and engine.num_spec == 0:
        raise Unavailable("speculative decoding needs a launch document with num_spec > 0")
    if spec:
        gens = engine.verb("speculative", prompts, max_tokens, drafts)
    else:
        gens = engine.verb("generate", prompts, max_tokens)
    choices = [
        {"index": i, "text": bytes(t for t in g["token_ids"] if t < 256).decode(errors="replace"),
         "finish_reason": "length", "prompt_token_ids": p, **g}
        for i, (g, p) in enumerate(zip(gens, prompts, strict=True))
    ]  # fmt: skip
    pt, ct = sum(map(len, prompts)), sum(len(g["token_ids"]) for g in gens)
    usage = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
    return {"choices": choices, "mode_used": "eager", "usage": usage}


def kv_fill(engine: Engine, body: object) -> dict:
    b = _fields(body, {"group", "offset", "length", "nonce", "rank"}, {"group", "offset", "length", "nonce"})
    off, n = _int(b["offset"], "offset"), _int(b["length"], "length", 1, 4096)
    if not isinstance(b["nonce"], str) or not 8 <= len(b["nonce"]) <= 128:
        raise Invalid("nonce must be 8 to 128 characters")
    digest = engine.verb("kv_fill", _int(b.get("rank", 0), "rank"), b["group"], off, n, b["nonce"])
    return {"group": b["group"], "offset": off, "length": n, "sha256": digest}


def kv_echo(engine: Engine, body: object) -> dict:
    b = _fields(body, {"group", "offset", "length", "rank"}, {"group", "offset", "length"})
    off, n = _int(b["offset"], "offset"), _int(b["length"], "length", 1, 1 << 20)
    digest = engine.verb("kv_echo", _int(b.get("rank", 0), "rank"), b["group"], off, n)
    return {"group": b["group"], "offset": off, "length": n, "sha256": digest}


def reload(engine: Engine, body: object) -> dict:
    b = _fields(body or {}, {"path", "seed"}, set())
    seed = b.get("seed")
    if seed is not None:
        seed = _int(seed, "seed", 0, 2**63 - 1)
    path = b.get("path")
    if path is not None and not isinstance(path, str):
        raise Invalid("path must be a string")
    return engine.verb("reload", path, seed)


def session_start(engine: Engine, body: object) -> dict:
    b = _fields(body, {"prompts", "max_tokens"}, {"prompts", "max_tokens"})
    if not isinstance(b["prompts"], list) or not 1 <= len(b["prompts"]) <= 64:
        raise Invalid("prompts must be 1 to 64 token-id lists")
    prompts = [_ids(p, "prompts") for p in b["prompts"]]
    return engine.verb("session_start", prompts, _int(b["max_tokens"], "max_tokens", 1, 256))


def session_step(engine: Engine, body: object, session: str) -> dict:
    b = _fields(body or {}, {"feed"}, set())
    feed = b.get("feed")
    if feed is not None:
        feed = _ids(feed, "feed")
    _live(engine, session)
    return engine.verb("session_step", feed)


def session_close(engine: Engine, _body: object, session: str) -> dict:
    _live(engine, session)
    return engine.verb("session_close")


def _live(engine: Engine, session: str) -> None:
    if engine.session is None or engine.session["id"] != session:
        raise ValueError(f"no live session {session!r}")


def metrics(engine: Engine) -> str:
    lines = []
    for name in COUNTERS:
        m = f"qualify_engine_{name}_total"
        lines += [
            f"# HELP {m} {name.replace('_', ' ')}",
            f"# TYPE {m} counter",
            f"{m} {engine.counters[name]}",
        ]
    return "\n".join(lines) + "\n"


def serve(engine: Engine, host: str, port: int) -> ThreadingHTTPServer:
    lock = threading.Lock()
    posts = {"/v1/completions": completions, "/qualify/reload": reload, "/qualify/kv-fill": kv_fill,
             "/qualify/kv-echo": kv_echo, "/qualify/capture": lambda e, _b: e.verb("capture"),
             "/qualify/probe": lambda e, _b: e.verb("probe"), "/qualify/sessions": session_start}  # fmt: skip
    gets = {"/v1/describe": lambda e: e.verb("describe"), "/qualify/kv-handles": lambda e: e.kv_handles()}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:  # the harness keeps the engine log; requests are noise
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: object) -> None:
            self._send(status, json.dumps(obj).encode())

        def _error(self, status: int, kind: str, message: str) -> None:
            self._json(status, {"error": {"type": kind, "message": message[:500]}})

        def _run(self, fn, *args) -> None:
            try:
                with lock:
                    out = fn(engine, *args)
            except Invalid as e:
                return self._error(422, "ValidationError", str(e))
            except OverCapacity as e:
                return self._error(409, "CapacityError", str(e))
            except Unavailable as e:
                return self._error(409, "ModeUnavailable", str(e))
            except ValueError as e:
                return self._error(400, "BadRequest", str(e))
            except Exception as e:  # noqa: BLE001 - an engine bug still answers in the protocol's shape
                return self._error(500, type(e).__name__, str(e))
            self._json(200, out)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if path == "/health":
                return self._json(200, {"status": "ok", "ready": True, "pid": os.getpid()})
            if path == "/metrics":
                with lock:
                    text = metrics(engine)
                return self._send(200, text.encode(), "text/plain; version=0.0.4")
            if path in gets:
                return self._run(gets[path])
            self._error(404 if path not in posts else 405, "HTTPError", f"GET {path} is not served")

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                return self._error(413, "HTTPError", f"body over {MAX_BODY} bytes")
            raw = self.rfile.read(n) if n else b""
            parts = path.strip("/").split("/")
            if len(parts) == 4 and parts[:2] == ["qualify", "sessions"] and parts[3] in ("step", "close"):
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    return self._error(422, "ValidationError", "the body is not JSON")
                fn = session_step if parts[3] == "step" else session_close
                return self._run(lambda e, b: fn(e, b, parts[2]), body)
            if path not in posts:
                return self._error(
                    404 if path not in gets else 405, "HTTPError", f"POST {path} is not served"
                )
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                return self._error(422, "ValidationError", "the body is not JSON")
            self._run(posts[path], body)

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    return httpd
