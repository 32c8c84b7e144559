"""The engine's HTTP API (docs/PROTOCOL.md): FastAPI app over one `Engine`, one worker owning the device.

All engine work runs on ONE worker thread that owns the device (its current CUDA device is the engine's),
so steps never interleave and CUDA calls never come from a thread with another current device. Errors
answer {"error": {"type", "message"}} with 4xx/5xx.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qualify.protocol import (
    CAPACITY_ERROR,
    CaptureResponse,
    Choice,
    CompletionRequest,
    CompletionResponse,
    Describe,
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
    Usage,
)

from . import REQUEST_LINE, kv_export, sessions
from .arena import CapacityError
from .engine import Engine
from .faults import FaultPlan, trigger
from .runner import ModeUnavailable
from .tokenizer import ByteTokenizer
from .weights import WeightsError

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4"  # Prometheus text exposition format


def _error(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"type": type_, "message": message}})


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) + " (see the request schema in qualify.protocol)"


def _own_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def engine_worker(engine: Engine) -> ThreadPoolExecutor:
    """The one thread that runs engine work, with the engine's device current on it."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="qualify-engine", initializer=_own_device, initargs=(engine.device,)
    )


def _speculative(engine: Engine, prompts, max_tokens, mode, drafts=None):
    from .spec import speculative_generate

    return speculative_generate(engine, prompts, max_tokens, mode, drafts=drafts)


def _describe(engine: Engine) -> dict:
    d = engine.describe()
    if engine.dcp is not None:  # every rank answers with its own record (a collective on every rank)
        d["dcp_ranks"] = engine.dcp.gather_objects(engine.dcp_record())
    return d


def _on_rank(engine: Engine, rank: int, fn, *args):
    """Run fn on the DCP rank that owns the allocation; every rank takes part in the gather, and rank 0
    answers with the owner's result (or raises its error). Folded: rank 0 only."""
    if engine.dcp is None:
        if rank != 0:
            raise ValueError(f"rank {rank} does not exist: this engine folds DCP into one process")
        return fn(engine, *args)
    if rank >= engine.dcp.world:
        raise ValueError(f"rank {rank} does not exist: the engine runs {engine.dcp.world} DCP ranks")
    mine: tuple = ("idle",)
    if engine.dcp.rank == rank:
        try:
            mine = ("ok", fn(engine, *args))
        except ValueError as exc:  # bad offsets and unknown groups: the client's mistake, answered 400
            mine = ("error", str(exc))
    out = engine.dcp.gather_objects(mine)[rank]
    if out[0] == "error":
        raise ValueError(out[1])
    return out[1]


def _kv_handles(engine: Engine) -> dict:
    mine = kv_export.kv_handles(engine)
    if engine.dcp is None:
        return mine
    every = engine.dcp.gather_objects(mine)
    return {**mine, "ranks": [{"rank": r, "groups": h["groups"]} for r, h in enumerate(every)]}


def _timed(engine: Engine, fn, *args):
    """fn(*args) on the worker, and what it cost: (its result, {seconds, prefill seconds, prompts})."""
    runner = engine.runner
    p0, n0, t0 = runner.prefill_seconds, runner.prefill_prompts, time.perf_counter()
    out = fn(*args)
    took = {
        "verb_s": round(time.perf_counter() - t0, 6),
        "prefill_s": round(runner.prefill_seconds - p0, 6),
        "prompts": runner.prefill_prompts - n0,
    }
    return out, took


def log_request(fields: dict) -> None:
    """A diagnostic line in the engine's log: never part of any answer, never read by a check."""
    print(REQUEST_LINE + json.dumps(fields, separators=(",", ":")), file=sys.stderr, flush=True)


# The verbs that step the model or touch its memory: with distributed DCP every rank runs each of them in
# lockstep.
VERBS = {
    "kv_handles": _kv_handles,
    "kv_fill": lambda e, rank, *a: _on_rank(e, rank, kv_export.kv_fill, *a),
    "kv_echo": lambda e, rank, *a: _on_rank(e, rank, kv_export.kv_echo, *a),
    "generate": lambda e, prompts, max_tokens, mode: _timed(e, e.generate, prompts, max_tokens, mode),
    "speculative": lambda e, *a: _timed(e, _speculative, e, *a),
    "reload": lambda e, path, seed: e.reload(path, seed),
    "capture": lambda e: e.capture(),
    "probe": lambda e: e.probe(),
    "describe": _describe,
    # Live sequences between steps (sessions.py): every rank holds the same sequences in its own memory.
    "session_start": lambda e, sid, prompts, max_tokens: sessions.session_start(e, sid, prompts, max_tokens),
    "session_step": lambda e, sid, feed: sessions.session_step(e, sid, feed),
    "session_close": lambda e, sid: sessions.session_close(e, sid),
}


def create_app(engine: Engine, faults: FaultPlan | None = None, lockstep=None) -> FastAPI:
    """lockstep: rank 0's dcp.Lockstep when DCP ranks follow this engine; every verb then runs on all."""
    app = FastAPI(title="qualify reference engine", docs_url=None, redoc_url=None)
    worker = engine_worker(engine)
    app.state.engine_worker = worker
    tok = ByteTokenizer()
    plan = faults or FaultPlan()

    def on_worker(fn, *args):
        """Run fn on the engine's worker thread (one at a time, in arrival order)."""
        return asyncio.get_running_loop().run_in_executor(worker, functools.partial(fn, *args))

    def verb(name: str, *args):
        """Run a model verb on the worker thread: here only, or broadcast to every DCP rank first."""
        if lockstep is not None:
            return on_worker(lockstep.call, name, *args)
        return on_worker(VERBS[name], engine, *args)

    if plan:

        @app.middleware("http")
        async def inject_faults(request: Request, call_next):
            trigger(plan, request.url.path)
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _error(422, "ValidationError", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, "HTTPError", str(exc.detail))

    @app.exception_handler(CapacityError)
    async def _capacity(_: Request, exc: CapacityError):
        engine.counters.capacity_refusals += 1
        return _error(409, CAPACITY_ERROR, str(exc))

    @app.exception_handler(ModeUnavailable)
    async def _mode(_: Request, exc: ModeUnavailable):
        return _error(409, ModeUnavailable.type_name, str(exc))

    @app.exception_handler(WeightsError)
    async def _weights(_: Request, exc: WeightsError):
        return _error(400, "WeightsError", str(exc))

    @app.exception_handler(torch.cuda.OutOfMemoryError)
    async def _oom(_: Request, exc: torch.cuda.OutOfMemoryError):
        engine.counters.cuda_oom += 1
        return _error(507, "CudaOutOfMemory", str(exc).splitlines()[0])

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        return _error(400, "BadRequest", str(exc))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        # An engine bug still answers in the protocol's error shape, so the harness can record it.
        return _error(500, type(exc).__name__, (str(exc).splitlines() or ["internal error"])[0])

    @app.get("/health")
    async def health() -> Health:
        return Health(status="ok", ready=True, pid=os.getpid())

    @app.get("/v1/describe")
    async def describe() -> Describe:
        return Describe.model_validate(await verb("describe"))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> CompletionResponse:
        t0 = time.perf_counter()
        prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in req.prompts()]
        if req.speculative and engine.cfg.num_spec == 0:
            raise ModeUnavailable("speculative decoding needs an engine started with --num-spec > 0")
        if req.speculative:
            asked = (prompts, req.max_tokens, req.mode, req.drafts)
            (gens, mode_used, _), took = await verb("speculative", *asked)
        else:
            (gens, mode_used), took = await verb("generate", prompts, req.max_tokens, req.mode)
        choices = [
            Choice(
                index=i,
                token_ids=g.token_ids,
                text=tok.decode(g.token_ids),
                top2_gaps=g.top2_gaps,
                top2_ids=g.top2_ids,
                finish_reason=g.finish_reason,
                prompt_token_ids=p,
                accepted_per_step=g.accepted_per_step,
            )  # fmt: skip
            for i, (g, p) in enumerate(zip(gens, prompts, strict=True))
        ]
        pt = sum(g.prompt_tokens for g in gens)
        ct = sum(len(g.token_ids) for g in gens)
        out = CompletionResponse(
            choices=choices,
            mode_used=mode_used,
            usage=Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct),
        )
        shape = {"n": len(prompts), "max_tokens": req.max_tokens, "mode": mode_used, "spec": req.speculative}
        log_request({**shape, **took, "handler_s": round(time.perf_counter() - t0, 6)})
        return out

    @app.post("/qualify/reload")
    async def reload(req: ReloadRequest) -> ReloadResponse:
        return ReloadResponse.model_validate(await verb("reload", req.path, req.seed))

    @app.get("/qualify/kv-handles")
    async def kv_handles() -> KvHandles:
        return KvHandles.model_validate(await verb("kv_handles"))

    @app.post("/qualify/kv-fill")
    async def kv_fill(req: KvFillRequest) -> KvDigest:
        out = await verb("kv_fill", req.rank, req.group, req.offset, req.length, req.nonce)
        return KvDigest.model_validate(out)

    @app.post("/qualify/kv-echo")
    async def kv_echo(req: KvEchoRequest) -> KvDigest:
        return KvDigest.model_validate(await verb("kv_echo", req.rank, req.group, req.offset, req.length))

    @app.post("/qualify/sessions")
    async def session_start(req: SessionStartRequest) -> SessionState:
        sid = uuid.uuid4().hex  # chosen here, so that every DCP rank files the session under one name
        return SessionState.model_validate(await verb("session_start", sid, req.prompts, req.max_tokens))

    @app.post("/qualify/sessions/{session}/step")
    async def session_step(session: str, req: SessionStepRequest) -> SessionState:
        return SessionState.model_validate(await verb("session_step", session, req.feed))

    @app.post("/qualify/sessions/{session}/close")
    async def session_close(session: str) -> SessionClosed:
        return SessionClosed.model_validate(await verb("session_close", session))

    @app.post("/qualify/capture")
    async def capture() -> CaptureResponse:
        return CaptureResponse.model_validate(await verb("capture"))

    @app.post("/qualify/probe")
    async def probe() -> ProbeResponse:
        return ProbeResponse.model_validate(await verb("probe"))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        lines = []
        counts = engine.counters.model_dump(exclude={"spec_acceptance_rate"})
        for name, value in counts.items():
            metric = f"qualify_engine_{name}_total"
            lines += [
                f"# HELP {metric} {name.replace('_', ' ')}",
                f"# TYPE {metric} counter",
                f"{metric} {value}",
            ]
        rate = engine.counters.spec_acceptance_rate
        lines += [
            "# HELP qualify_engine_spec_acceptance_rate accepted / drafted speculative draft tokens",
            "# TYPE qualify_engine_spec_acceptance_rate gauge",
            f"qualify_engine_spec_acceptance_rate {rate:.6f}",
            "# HELP qualify_engine_boot_seconds time to construct the engine",
            "# TYPE qualify_engine_boot_seconds gauge",
            f"qualify_engine_boot_seconds {engine.boot_seconds:.6f}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type=METRICS_CONTENT_TYPE)

    return app


def protocol_openapi() -> dict:
    """The engine protocol as an OpenAPI document: the routes and messages of `create_app`, built around a
    stand-in that has only the device the worker thread needs (nothing is served or run)."""
    from types import SimpleNamespace

    from qualify.protocol import PROTOCOL_VERSION

    app = create_app(SimpleNamespace(device=torch.device("cpu")))  # type: ignore[arg-type]
    app.state.engine_worker.shutdown(wait=False)
    doc = app.openapi()
    doc["info"] = {
        "title": "qualify engine protocol",
        "version": PROTOCOL_VERSION,
        "description": "What an engine serves to be qualified by `qualify run` (docs/PROTOCOL.md). The "
        "launch document (`serve --launch FILE`) and the manifest (`python -m MODULE manifest`) are not "
        "served: their schemas are LaunchDocument and EngineManifest under components.",
    }
    return _protocol_errors(doc)


def _protocol_errors(doc: dict) -> dict:
    """Every error answers ErrorBody ({"error": {type, message}}): a 422 is a ValidationError in that shape
    (never FastAPI's {"detail": [...]}), and every other status is documented as the default response. The
    launch document and the manifest join the components, so one file holds every schema of the contract."""
    from qualify.protocol import EngineManifest, ErrorBody, LaunchDocument

    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model in (ErrorBody, LaunchDocument, EngineManifest):
        one = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(one.pop("$defs", {}))
        schemas[model.__name__] = one
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    ok = doc["paths"]["/metrics"]["get"]["responses"]["200"]
    ok["content"] = {METRICS_CONTENT_TYPE: ok["content"].pop("text/plain")}
    for ops in doc["paths"].values():
        for op in ops.values():
            responses = op["responses"]
            if "422" in responses:
                responses["422"] = {
                    "description": "ValidationError: the body does not fit the schema",
                    "content": error,
                }
            responses["default"] = {
                "description": 'any 4xx/5xx: {"error": {type, message}}',
                "content": error,
            }
    return doc
