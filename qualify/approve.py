"""Rollout decisions: verify a subject's receipts (`gather`), judge them against a policy (`evaluate`, pure),
and append the signed decision to the log (`record`)."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from qualify.cel import Budget, CostLimitError
from qualify.errors import UsageError
from qualify.policy import LoadedPolicy, PolicyError
from receipts import dsse
from receipts.approval_rows import APPROVAL_PREDICATE_TYPE
from receipts.canonical import canonical_json
from receipts.checkpoint import NoteVerifier
from receipts.errors import ReceiptsError, VerificationError
from receipts.keys import SigningKey
from receipts.statement import PREDICATE_TYPE, STATEMENT_TYPE, parse_time

if TYPE_CHECKING:
    from receipts.store import Store

SUBJECT_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")

DecisionValue = Literal["approved", "denied", "warn"]


def check_subject(subject: str) -> str:
    """The subject digest, or UsageError when it is not 'sha256:<64 hex>'."""
    subject = subject.strip()
    if not SUBJECT_DIGEST.match(subject):
        raise UsageError(
            f"subject {subject!r} is not a digest; "
            "pass sha256:<64 lower-case hex> (an image or config digest)"
        )
    return subject


@dataclass(frozen=True)
class Candidate:
    """A stored receipt about the subject. `predicate` comes from the verified envelope, never the query
    table; `problem` says why the receipt did not verify (then it counts for nothing)."""

    receipt_id: str
    log_idx: int
    keyid: str | None
    predicate: dict[str, Any] | None
    problem: str | None = None

    @property
    def host(self) -> str | None:
        host = (self.predicate or {}).get("host")
        return host.get("hostname") if isinstance(host, dict) else None

    @property
    def finished_at(self) -> datetime | None:
        return parse_time((self.predicate or {}).get("finished_at"))


class ReceiptEvaluation(BaseModel):
    """How one receipt fared: whether it counts, and every reason it does not."""

    receipt_id: str
    log_index: int
    host: str | None
    verdict: str | None
    finished_at: datetime | None
    counted: bool
    failures: list[str] = Field(default_factory=list)


class Decision(BaseModel):
    """The outcome of a policy for a subject; `approval_id`/`log_index` are set once it is recorded."""

    decision: DecisionValue
    mode: Literal["enforce", "warn"]
    subject: str
    policy_digest: str
    policy_name: str | None
    receipt_ids: list[str] = Field(description="the receipts the decision relied on (those that counted)")
    hosts: list[str] = Field(description="distinct hosts of the receipts that counted")
    required_hosts: int
    reasons: list[str] = Field(
        description="why the build was not approved: the shortfall, and why each verified receipt failed "
        "the policy; empty when approved"
    )
    ignored: list[str] = Field(
        default_factory=list,
        description="receipts that did not count and why, apart from the reasons: those that do not verify "
        "(always), and those that failed the policy when the build was approved anyway",
    )
    evaluations: list[ReceiptEvaluation]
    tree_size: int | None = Field(
        None, description="size of the signed checkpoint receipts were verified against"
    )
    decided_at: datetime
    approval_id: str | None = None
    log_index: int | None = None

    @property
    def exit_code(self) -> int:
        """0 approved (or warn), 1 denied."""
        return 1 if self.decision == "denied" else 0


def _label(candidate: Candidate) -> str:
    host = candidate.host or "unknown host"
    return f"receipt {candidate.receipt_id[:12]} (log #{candidate.log_idx}, {host})"


def _failures(loaded: LoadedPolicy, candidate: Candidate, now: datetime, budget: Budget) -> list[str]:
    """Every reason this receipt does not count, in policy order; empty when it counts. PolicyError when the
    conditions spend the decision's evaluation budget."""
    if candidate.problem is not None:
        return [f"does not verify, so it counts for nothing: {candidate.problem}"]
    policy = loaded.policy
    predicate = candidate.predicate or {}
    failures: list[str] = []
    if policy.trusted_keyids is not None and candidate.keyid not in policy.trusted_keyids:
        failures.append(f"signed by key {str(candidate.keyid)[:16]}, which the policy does not trust")
    verdict = predicate.get("verdict")
    if verdict != policy.verdict:
        failures.append(f"verdict is {verdict}, the policy requires {policy.verdict}")
    max_age = policy.max_age_delta
    if max_age is not None:
        finished = candidate.finished_at
        if finished is None:
            failures.append("has no finished_at, so its age is unknown")
        elif now - finished > max_age:
            age_h = (now - finished).total_seconds() / 3600
            failures.append(
                f"expired: finished {finished.isoformat()} ({age_h:.1f} h ago), "
                f"older than max_age {policy.max_age}"
            )
        elif finished - now > max_age:
            failures.append(
                f"finished_at {finished.isoformat()} lies in the future; check the signer's clock"
            )
    for condition in loaded.conditions:
        try:
            why = condition.evaluate(predicate, budget)
        except CostLimitError:
            raise PolicyError(
                f"policy {loaded.source}: condition {condition.name!r} spent the evaluation budget "
                f"({budget.describe()}) on {_label(candidate)}; simplify it"
            ) from None
        if why is not None:
            failures.append(f"condition {condition.name!r} {why}: {condition.expr}")
    failures.extend(_observed_failures(policy.require_observed, predicate))
    failures.extend(
        _observed_failures(
            policy.require_monitored, predicate, ("monitored", "observed"), "require_monitored"
        )
    )
    return failures


def _observed_failures(
    patterns: list[str],
    predicate: dict[str, Any],
    sources: tuple[str, ...] = ("observed",),
    rule: str = "require_observed",
) -> list[str]:
    """require_observed: each pattern must match a check condition of the receipt, and every condition it
    matches must hold with source `observed` (not `derived`, not the engine's word); require_monitored
    accepts `monitored` (the harness's monitor inside the engine process) or `observed`."""
    if not patterns:
        return []
    flat: dict[str, Any] = {}
    checks = predicate.get("checks")
    for check in checks if isinstance(checks, list) else []:
        conditions = check.get("conditions") if isinstance(check, dict) else None
        if isinstance(conditions, dict):
            flat.update({f"{check.get('name')}.{name}": c for name, c in conditions.items()})
    out: list[str] = []
    for pattern in patterns:
        hits = sorted(k for k in flat if fnmatch.fnmatchcase(k, pattern))
        if not hits:
            out.append(f"{rule} {pattern!r}: no such condition in the receipt")
        for key in hits:
            c = flat[key] if isinstance(flat[key], dict) else {}
            if c.get("source") not in sources:
                out.append(
                    f"{rule} {key}: source is {c.get('source')}, the policy requires {' or '.join(sources)}"
                )
            elif c.get("holds") is not True:
                out.append(f"{rule} {key}: does not hold")
    return out


def evaluate(
    loaded: LoadedPolicy,
    subject: str,
    candidates: list[Candidate],
    now: datetime | None = None,
    tree_size: int | None = None,
    budget: Budget | None = None,
    failures: dict[int, list[str]] | None = None,
) -> Decision:
    """Judge `candidates` (the subject's receipts) against the policy. Pure: nothing is read or written.
    All condition evaluations share `budget` (default: DECISION_STEPS / DECISION_SECONDS); PolicyError
    (bad input, nothing to record) when they spend it. `failures` (by log index): what _failures already
    found for candidates judged as they were gathered (decide)."""
    now = now or datetime.now(UTC)
    budget = budget or Budget()
    policy = loaded.policy
    evaluations: list[ReceiptEvaluation] = []
    unverified: list[str] = []
    notes: list[str] = []
    counted: list[Candidate] = []
    for candidate in sorted(candidates, key=lambda c: c.log_idx):
        known = None if failures is None else failures.get(candidate.log_idx)
        failed = known if known is not None else _failures(loaded, candidate, now, budget)
        evaluations.append(
            ReceiptEvaluation(
                receipt_id=candidate.receipt_id,
                log_index=candidate.log_idx,
                host=candidate.host,
                verdict=(candidate.predicate or {}).get("verdict"),
                finished_at=candidate.finished_at,
                counted=not failed,
                failures=failed,
            )
        )
        if failed:
            target = unverified if candidate.problem is not None else notes
            target.extend(f"{_label(candidate)}: {failure}" for failure in failed)
        else:
            counted.append(candidate)
    hosts = sorted({c.host or "" for c in counted})
    enough = len(hosts) >= policy.min_hosts
    reasons: list[str] = []
    if not enough:
        if not candidates:
            reasons.append(f"no receipts about subject {subject} in the log")
        else:
            have = ", ".join(h or "(no hostname)" for h in hosts) or "none"
            reasons.append(
                f"{len(counted)} qualifying receipt(s) from {len(hosts)} distinct host(s) ({have}); "
                f"the policy needs {policy.min_hosts}"
            )
    if enough:
        decision: DecisionValue = "approved"
        ignored = unverified + notes
    else:
        decision = "warn" if policy.mode == "warn" else "denied"
        reasons.extend(notes)
        ignored = unverified
    return Decision(
        decision=decision,
        mode=policy.mode,
        subject=subject,
        policy_digest=loaded.digest,
        policy_name=policy.name,
        receipt_ids=[c.receipt_id for c in counted],
        hosts=hosts,
        required_hosts=policy.min_hosts,
        reasons=reasons,
        ignored=ignored,
        evaluations=evaluations,
        tree_size=tree_size,
        decided_at=now,
    )


# --------------------------------------------------------------------------- store side


def _signed_predicate(envelope: bytes, subject: str) -> tuple[dict[str, Any] | None, str | None]:
    """The predicate exactly as signed, or why it cannot be used; the signed subjects must name `subject`
    (the query tables could be edited to attach a receipt to another build)."""
    try:
        statement = json.loads(dsse.parse(envelope).payload)
    except (VerificationError, ValueError) as exc:
        return None, f"its envelope does not parse: {exc}"
    if not isinstance(statement, dict) or not isinstance(statement.get("predicate"), dict):
        return None, "its statement has no predicate"
    if statement.get("predicateType") != PREDICATE_TYPE:
        # e.g. a signed approval listed as a receipt through a planted query row
        return None, f"it is not a qualification receipt (predicateType {statement.get('predicateType')!r})"
    digests = {
        f"{algorithm}:{value}"
        for item in statement.get("subject") or []
        if isinstance(item, dict)
        for algorithm, value in (item.get("digest") or {}).items()
    }
    if subject not in digests:
        return None, f"its signed subjects do not include {subject}; the query tables disagree with the log"
    return statement["predicate"], None


# Receipts verified per step of a decision; the policy is applied after each step, so a policy that spends
# its evaluation budget is refused after the first steps, not after verifying every receipt.
GATHER_CHUNK = 1000


def iter_gather(
    store: Store, subject: str, verifiers: list[NoteVerifier] | None = None
) -> Iterator[tuple[list[Candidate], int | None]]:
    """gather() in steps of GATHER_CHUNK receipts (in log order): each step's candidates, verified, with
    the checkpoint size they were verified against. The last good checkpoint (the latest stored one that
    verifies with `verifiers`, default the trusted log key) is found once per decision and every step is
    verified against it. The signed bytes are judged, not the query rows (an edited row cannot change
    them), so the query-row check is left off."""
    records = store.list_receipts(subject=subject, limit=None)
    if not records:
        return
    verifiers = verifiers or [store.trusted_log_key()[0]]
    good = None
    # The last good checkpoint (verified with the trusted log key), found once per decision; when none
    # is, every receipt fails its checkpoint check, saying why (verify_receipts).
    with contextlib.suppress(ReceiptsError):
        good = store.good_head(verifier=(verifiers[0], "the log key given to verify with"))
    for start in range(0, len(records), GATHER_CHUNK):
        chunk = records[start : start + GATHER_CHUNK]
        candidates: list[Candidate] = []
        tree_size: int | None = None
        for record, (report, envelope) in zip(
            chunk, store.verify_receipts(chunk, verifiers, good=good, check_row=False), strict=True
        ):
            tree_size = report.checkpoint_size if report.checkpoint_size is not None else tree_size
            if not report.ok or envelope is None:
                problem = report.problem or "a check failed: " + ", ".join(
                    k for k, v in report.checks.items() if not v
                )
                candidates.append(Candidate(record.id, record.log_idx, record.keyid, None, problem))
                continue
            predicate, problem = _signed_predicate(envelope, subject)
            candidates.append(Candidate(record.id, record.log_idx, report.keyid, predicate, problem))
        yield candidates, tree_size


def gather(
    store: Store, subject: str, verifiers: list[NoteVerifier] | None = None
) -> tuple[list[Candidate], int | None]:
    """The subject's receipts, each verified (bytes, signature at its log index, inclusion under the latest
    signed checkpoint); returns them with the checkpoint size they were verified against.

    `verifiers`: the trusted checkpoint keys; default the log key recorded in the store, which whoever
    rewrote the database could have replaced, so callers holding the real log key pass it."""
    candidates: list[Candidate] = []
    tree_size: int | None = None
    for chunk, size in iter_gather(store, subject, verifiers):
        candidates.extend(chunk)
        tree_size = size if size is not None else tree_size
    return candidates, tree_size


def gather_attested(
    store: Store, attestations: list[Any], subject: str, verifiers: list[NoteVerifier]
) -> tuple[list[Candidate], int | None]:
    """Receipts found outside the store (attached to an image in its registry: qualify.oci.Attestation),
    each verified as `gather` verifies a stored one: its inclusion in this log under a checkpoint signed
    by `verifiers` (the tlog-proof that came with it; without one, only a receipt this store holds can be
    placed), its signature by a key this log trusted at that index, and its signed subjects."""
    from receipts import merkle
    from receipts.checkpoint import verify_tlog_proof
    from receipts.errors import ReceiptsError

    history = store.key_history()
    candidates: list[Candidate] = []
    tree_size: int | None = None
    for found in attestations:
        rid, idx = found.receipt_id, -1
        try:
            if found.proof is not None:
                parsed, cp = verify_tlog_proof(found.proof, merkle.leaf_hash(found.envelope), verifiers)
                idx, size = parsed.index, cp.size
            else:
                report = store.verify_receipt(rid, verifiers=verifiers, history=history)
                if not report.ok:
                    raise VerificationError(report.problem or "it does not verify in this log")
                idx, size = report.log_idx, report.checkpoint_size
            keyid = history.signers(dsse.parse(found.envelope), idx, "receipt")[0]
        except (ReceiptsError, ValueError) as exc:
            where = ", ".join(found.found_in) or "the registry"
            candidates.append(Candidate(rid, idx, None, None, f"found in {where}, but {exc}"))
            continue
        tree_size = max(tree_size or 0, size or 0)
        predicate, problem = _signed_predicate(found.envelope, subject)
        candidates.append(Candidate(rid, idx, keyid, predicate, problem))
    return candidates, tree_size


def decide(
    store: Store,
    loaded: LoadedPolicy,
    subject: str,
    now: datetime | None = None,
    verifiers: list[NoteVerifier] | None = None,
    attestations: list[Any] | None = None,
    budget: Budget | None = None,
) -> Decision:
    """Verify the subject's receipts in `store` (or, given `attestations`, those receipts found with the
    image in its registry) and judge them against the policy (nothing is written). The policy is applied
    to each step of verified receipts as it comes, under one budget: a policy that spends it
    (PolicyError) stops the verification there."""
    subject = check_subject(subject)
    now = now or datetime.now(UTC)
    budget = budget or Budget()
    if attestations is not None:
        candidates, tree_size = gather_attested(
            store, attestations, subject, verifiers or [store.log_verifier()]
        )
        return evaluate(loaded, subject, candidates, now=now, tree_size=tree_size, budget=budget)
    candidates = []
    failures: dict[int, list[str]] = {}
    tree_size = None
    for chunk, size in iter_gather(store, subject, verifiers):
        for candidate in chunk:
            failures[candidate.log_idx] = _failures(loaded, candidate, now, budget)
        candidates.extend(chunk)
        tree_size = size if size is not None else tree_size
    return evaluate(
        loaded, subject, candidates, now=now, tree_size=tree_size, budget=budget, failures=failures
    )


def approval_statement(decision: Decision, loaded: LoadedPolicy) -> dict[str, Any]:
    """The in-toto statement of a decision: about the subject, carrying the policy and every reason."""
    algorithm, _, value = decision.subject.partition(":")
    predicate = decision.model_dump(mode="json", exclude={"approval_id", "log_index"})
    predicate["policy"] = loaded.policy.model_dump(mode="json")
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": decision.subject, "digest": {algorithm: value}}],
        "predicateType": APPROVAL_PREDICATE_TYPE,
        "predicate": predicate,
    }


def record(store: Store, decision: Decision, loaded: LoadedPolicy, key: SigningKey) -> Decision:
    """Sign the decision and append it to the log; returns the decision with its approval id and index."""
    payload = canonical_json(approval_statement(decision, loaded))
    envelope = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, payload, key)
    stored = store.append_approval(
        envelope,
        subject=decision.subject,
        decision=decision.decision,
        policy_digest=decision.policy_digest,
        receipt_ids=decision.receipt_ids,
        reasons=decision.reasons,
    )
    return decision.model_copy(update={"approval_id": stored.id, "log_index": stored.log_idx})
