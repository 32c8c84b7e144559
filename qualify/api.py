"""The read API (`qualify serve`): FastAPI over the store (receipts, envelopes, proofs, checkpoints,
approvals; every response a pydantic model) and `POST /v1/decisions` (writes), behind a token."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, Field
from sqlalchemy.exc import SQLAlchemyError

from qualify import __version__, params
from qualify.api_guard import BoundedJSONRoute, RequestGuard, token_problem, validation_problem
from qualify.approve import SUBJECT_DIGEST, Decision, decide, record
from qualify.limits import MAX_BODY_BYTES
from qualify.policy import Policy, PolicyError, load_policy_data
from receipts import merkle
from receipts.checkpoint import Checkpoint, NoteVerifier, format_tlog_proof
from receipts.errors import NotFound, ReceiptsError, TamperError
from receipts.keys import SigningKey
from receipts.records import ApprovalRecord, ReceiptRecord
from receipts.store import Store

MAX_PAGE = 500
# Bounds that keep every integer a database can hold; a bigger offset or size is refused as bad input.
MAX_INDEX = 2**62
MAX_HOST = params.MAX_HOST
RECEIPT_ID = r"^[0-9a-f]{4,64}$"
SUBJECT = SUBJECT_DIGEST.pattern


# --------------------------------------------------------------------------- response models


class Problem(BaseModel):
    """Every error: one line saying what is wrong and what to do."""

    detail: str


class SubjectOut(BaseModel):
    name: str
    digest: str


class ReceiptSummary(BaseModel):
    id: str = Field(description="sha256 hex of the stored envelope bytes")
    log_index: int
    verdict: str
    target: str
    host: str
    started_at: datetime
    finished_at: datetime
    keyid: str
    subjects: list[SubjectOut]


class ReceiptDetail(ReceiptSummary):
    predicate: dict[str, Any] = Field(
        description="the qualification predicate (see `qualify receipts schema`)"
    )


class ReceiptPage(BaseModel):
    items: list[ReceiptSummary]
    limit: int
    offset: int
    next_offset: int | None = Field(description="offset of the next page; null on the last page")
    total: int | None = Field(None, description="how many receipts match the filters in all")


class SignatureOut(BaseModel):
    keyid: str
    sig: str = Field(description="base64")


class EnvelopeOut(BaseModel):
    """The DSSE envelope exactly as stored (its RFC 8785 bytes hash to the receipt id)."""

    payloadType: str
    payload: str = Field(description="base64 of the in-toto statement")
    signatures: list[SignatureOut]


class CheckpointOut(BaseModel):
    origin: str
    size: int
    root_hash: str = Field(description="hex")
    note: str = Field(description="the C2SP signed note, verbatim")


class InclusionProofOut(BaseModel):
    receipt_id: str
    log_index: int
    tree_size: int
    leaf_hash: str = Field(description="hex")
    hashes: list[str] = Field(description="hex, the leaf's sibling first (RFC 9162)")
    root_hash: str
    checkpoint: str = Field(description="the signed checkpoint of tree_size")
    tlog_proof: str = Field(description="the same proof as a c2sp.org/tlog-proof@v1 document")


class ConsistencyProofOut(BaseModel):
    first: int
    second: int
    first_root: str
    second_root: str
    hashes: list[str]


class ApprovalOut(BaseModel):
    id: str
    log_index: int
    subject: str
    decision: str
    policy_digest: str
    receipt_ids: list[str]
    reasons: list[str]
    keyid: str
    created_at: datetime


class ApprovalPage(BaseModel):
    items: list[ApprovalOut]
    limit: int
    offset: int
    next_offset: int | None


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    log_size: int
    decisions_enabled: bool


class DecisionRequest(BaseModel):
    subject: str = Field(pattern=SUBJECT, description="sha256:<hex> of the engine image or config")
    policy: Policy
    record: bool = Field(True, description="append the signed decision to the log")


# --------------------------------------------------------------------------- conversions


def _summary(r: ReceiptRecord) -> dict[str, Any]:
    return {
        "id": r.id,
        "log_index": r.log_idx,
        "verdict": r.verdict,
        "target": r.target,
        "host": r.host,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
        "keyid": r.keyid,
        "subjects": [{"name": s.name, "digest": s.digest} for s in r.subjects],
    }


def _approval(a: ApprovalRecord) -> ApprovalOut:
    return ApprovalOut(
        id=a.id,
        log_index=a.log_idx,
        subject=a.subject,
        decision=a.decision,
        policy_digest=a.policy_digest,
        receipt_ids=list(a.receipt_ids),
        reasons=list(a.reasons),
        keyid=a.keyid,
        created_at=a.created_at,
    )


def _checkpoint_out(note: str) -> CheckpointOut:
    # The note's body is parsed without trusting it; clients verify it with the log's key themselves.
    body = note[: note.rfind("\n\n") + 1]
    cp = Checkpoint.parse(body)
    return CheckpointOut(origin=cp.origin, size=cp.size, root_hash=cp.root.hex(), note=note)


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "bad input"},
    404: {"model": Problem, "description": "not in the store"},
    409: {"model": Problem, "description": "the stored log contradicts itself (tampering)"},
    422: {
        "model": Problem,
        "description": "a parameter or body field is invalid (one line, input not echoed)",
    },
    503: {"model": Problem, "description": "the database cannot be reached"},
}


# --------------------------------------------------------------------------- the app


def create_app(
    store: Store,
    *,
    token: str | None = None,
    signing_key: SigningKey | None = None,
    verifiers: list[NoteVerifier] | None = None,
) -> FastAPI:
    """The API over an open store. Decisions need `token` (and `signing_key` to record them); their
    receipts are verified against `verifiers`, the trusted log keys (`qualify serve` passes those
    `qualify approve` would use; None: the key the store records, for tests only). /docs and /redoc are
    served with their assets from the installed package, so they work offline."""
    app: FastAPI = FastAPIOffline(
        title="qualify",
        version=__version__,
        description="Signed qualification receipts, their Merkle log, and rollout decisions.",
    )
    app.router.route_class = BoundedJSONRoute
    app.add_middleware(
        RequestGuard, limit=MAX_BODY_BYTES, token=token, protected=frozenset({"/v1/decisions"})
    )
    app.add_exception_handler(RequestValidationError, validation_problem)

    @app.exception_handler(NotFound)
    def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": exc.diagnostics()})

    @app.exception_handler(TamperError)
    def _tampered(_: Request, exc: TamperError) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": exc.diagnostics()})

    @app.exception_handler(ReceiptsError)
    def _receipts_error(_: Request, exc: ReceiptsError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": exc.diagnostics()})

    @app.exception_handler(SQLAlchemyError)
    def _database(_: Request, exc: SQLAlchemyError) -> JSONResponse:
        cause = getattr(exc, "orig", None) or exc
        line = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        return JSONResponse(status_code=503, content={"detail": f"database error: {line}"})

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        # RequestGuard already refused a wrong token before the body was read; this documents the header.
        problem = token_problem(token, authorization)
        if problem is not None:
            raise HTTPException(401, problem, headers={"WWW-Authenticate": "Bearer"})

    def served_from(response: Response) -> None:
        # What every read serves is covered by the last checkpoint that verifies with the trusted log key:
        # its size goes with the response, and a notice when rows beyond it are not served.
        good = store.good_head()
        response.headers["Qualify-Checkpoint-Size"] = str(good.size)
        notice = good.notice()
        if notice is not None:
            response.headers["Qualify-Notice"] = notice

    served = [Depends(served_from)]

    def _page(offset: int, limit: int, got: int) -> int | None:
        return offset + limit if got > limit else None

    @app.get("/health", response_model=Health, tags=["service"])
    def health() -> Health:
        return Health(
            status="ok", version=__version__, log_size=store.size(), decisions_enabled=token is not None
        )

    @app.get(
        "/v1/receipts", response_model=ReceiptPage, responses=ERRORS, tags=["receipts"], dependencies=served
    )
    def list_receipts(
        verdict: Literal["qualified", "rejected", "aborted"] | None = None,
        subject: Annotated[
            str | None, Query(max_length=80, description="sha256:<hex> (or the 64 hex digits alone)")
        ] = None,
        host: Annotated[str | None, Query(max_length=MAX_HOST, description="the receipt's hostname")] = None,
        since: Annotated[
            str | None,
            Query(
                max_length=64,
                description="finished at or after: a duration ago (30m, 24h, 7d, 2w) or an ISO 8601 time "
                "(UTC unless it names an offset), e.g. 2025-06-01T00:00:00Z; the CLI's --since grammar",
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Query(ge=0, le=MAX_INDEX)] = 0,
    ) -> ReceiptPage:
        """Receipts newest first (by log index), as `qualify receipts list` lists them."""
        try:
            when = None if since is None else params.parse_since(since)
            digest = None if subject is None else params.parse_subject(subject)
            hostname = None if host is None else params.parse_host(host)
        except params.ParamError as error:
            raise HTTPException(422, str(error)) from None
        records, total = store.find_receipts(
            verdict=verdict, since=when, subject=digest, host=hostname, limit=limit + 1, offset=offset
        )
        return ReceiptPage(
            items=[ReceiptSummary(**_summary(r)) for r in records[:limit]],
            limit=limit,
            offset=offset,
            next_offset=_page(offset, limit, len(records)),
            total=total,
        )

    @app.get(
        "/v1/receipts/{receipt_id}",
        response_model=ReceiptDetail,
        responses=ERRORS,
        tags=["receipts"],
        dependencies=served,
    )
    def show_receipt(receipt_id: Annotated[str, Path(pattern=RECEIPT_ID)]) -> ReceiptDetail:
        r = store.get_receipt(receipt_id)
        return ReceiptDetail(**_summary(r), predicate=r.predicate)

    @app.get(
        "/v1/receipts/{receipt_id}/envelope",
        response_model=EnvelopeOut,
        responses=ERRORS,
        tags=["receipts"],
        dependencies=served,
    )
    def receipt_envelope(receipt_id: Annotated[str, Path(pattern=RECEIPT_ID)]) -> EnvelopeOut:
        r = store.get_receipt(receipt_id)
        return EnvelopeOut.model_validate(json.loads(r.envelope or b""))

    @app.get(
        "/v1/receipts/{receipt_id}/proof",
        response_model=InclusionProofOut,
        responses=ERRORS,
        tags=["receipts"],
        dependencies=served,
    )
    def receipt_proof(
        receipt_id: Annotated[str, Path(pattern=RECEIPT_ID)],
        size: Annotated[
            int | None, Query(ge=1, le=MAX_INDEX, description="tree size; default latest")
        ] = None,
    ) -> InclusionProofOut:
        r = store.get_receipt(receipt_id)
        current = store.good_head().size  # only checkpoints that verify with the log key are served
        size = current if size is None else size
        if size > current or size <= r.log_idx:
            raise HTTPException(
                400,
                f"tree size {size} must be between {r.log_idx + 1} and {current} to include log #{r.log_idx}",
            )
        entry = store.entry(r.log_idx)
        proof = store.inclusion_proof(r.log_idx, size)
        note, cp = store.verified_checkpoint(size)
        # Never hand out a proof that does not verify under the signed root.
        merkle.verify_inclusion(r.log_idx, size, merkle.leaf_hash(r.envelope or b""), proof, cp.root)
        return InclusionProofOut(
            receipt_id=r.id,
            log_index=r.log_idx,
            tree_size=size,
            leaf_hash=entry.leaf_hash.hex(),
            hashes=[h.hex() for h in proof],
            root_hash=cp.root.hex(),
            checkpoint=note,
            tlog_proof=format_tlog_proof(r.log_idx, proof, note),
        )

    @app.get(
        "/v1/log/checkpoint",
        response_model=CheckpointOut,
        responses=ERRORS,
        tags=["log"],
        dependencies=served,
    )
    def latest_checkpoint() -> CheckpointOut:
        return _checkpoint_out(store.good_checkpoint())

    @app.get(
        "/v1/log/consistency",
        response_model=ConsistencyProofOut,
        responses=ERRORS,
        tags=["log"],
        dependencies=served,
    )
    def consistency(
        first: Annotated[int, Query(ge=1, le=MAX_INDEX, description="the older tree size")],
        second: Annotated[
            int | None, Query(ge=1, le=MAX_INDEX, description="the newer size; default latest")
        ] = None,
    ) -> ConsistencyProofOut:
        current = store.good_head().size
        second = current if second is None else second
        if not 1 <= first <= second <= current:
            raise HTTPException(
                400, f"need 1 <= first ({first}) <= second ({second}) <= log size ({current})"
            )
        return ConsistencyProofOut(
            first=first,
            second=second,
            first_root=store.root(first).hex(),
            second_root=store.root(second).hex(),
            hashes=[h.hex() for h in store.consistency_proof(first, second)],
        )

    @app.get(
        "/v1/approvals",
        response_model=ApprovalPage,
        responses=ERRORS,
        tags=["approvals"],
        dependencies=served,
    )
    def list_approvals(
        subject: Annotated[
            str | None, Query(max_length=80, description="sha256:<hex> (or the 64 hex digits alone)")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Query(ge=0, le=MAX_INDEX)] = 0,
    ) -> ApprovalPage:
        """Rollout decisions newest first (by log index)."""
        try:
            digest = None if subject is None else params.parse_subject(subject)
        except params.ParamError as error:
            raise HTTPException(422, str(error)) from None
        window = store.list_approvals(subject=digest, limit=limit + 1, offset=offset, newest_first=True)
        return ApprovalPage(
            items=[_approval(a) for a in window[:limit]],
            limit=limit,
            offset=offset,
            next_offset=_page(offset, limit, len(window)),
        )

    @app.get("/v1/approvals/{approval_id}", response_model=ApprovalOut, responses=ERRORS, tags=["approvals"])
    def show_approval(approval_id: Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]) -> ApprovalOut:
        return _approval(store.get_approval(approval_id))

    @app.post(
        "/v1/decisions",
        response_model=Decision,
        responses={
            **ERRORS,
            401: {"model": Problem, "description": "no or wrong bearer token (checked before the body)"},
            413: {"model": Problem, "description": f"the body is larger than {MAX_BODY_BYTES} bytes"},
        },
        dependencies=[Depends(require_token), *served],
        tags=["approvals"],
    )
    def post_decision(body: DecisionRequest) -> Decision:
        try:
            # Only what the client set: a policy that states no requirement is refused, not defaulted.
            loaded = load_policy_data(
                body.policy.model_dump(mode="json", exclude_unset=True), source="in the request"
            )
            # Checkpoints checked with the trust `qualify approve` uses (serve passes the local log key or
            # its --vkey), never with the key the database names.
            decision = decide(store, loaded, body.subject, verifiers=verifiers)
        except PolicyError as exc:
            raise HTTPException(400, str(exc)) from None
        if body.record:
            if signing_key is None:
                raise HTTPException(
                    400, "this server has no signing key; send record=false or start it with --key"
                )
            decision = record(store, decision, loaded, signing_key)
        return decision

    return app
