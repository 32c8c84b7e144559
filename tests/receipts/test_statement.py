"""In-toto statement and qualification predicate: round trips, canonical bytes, schema, refusals."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import jsonschema_rs
import pytest
import rfc8785
from pydantic import ValidationError

from receipts import dsse, keys
from receipts.canonical import canonical_json, digest, sha256_hex
from receipts.errors import VerificationError
from receipts.statement import (
    PREDICATE_TYPE,
    QualificationPredicate,
    Statement,
    Subject,
    build_statement,
    config_digest,
    parse_statement,
    predicate_json_schema,
    statement_bytes,
    statement_json_schema,
)

CONFIG = {"preset": "tiny", "block_size": 2304, "dcp_size": 4, "kda_decode_backend": "auto"}
IMAGE = "sha256:" + "ab" * 32


def predicate_dict(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "request": {"layout": [2304, 2304, 2304, 9216], "kda_backend": "auto", "preset": "tiny"},
        "engine": {
            "name": "qualify-reference",
            "version": "0.1.0",
            "code_digest": IMAGE,
            "config_digest": config_digest(CONFIG),
            "config": CONFIG,
        },
        "backend": {"requested": "auto", "resolved": "torch", "reason": "cpu", "kernel_names": []},
        "layout": {
            "spans": [2304, 2304, 2304, 9216],
            "chunk": 9216,
            "ratios": [4, 4, 4, 1],
            "groups": [{"index": 3, "kind": "attention", "layers": [6, 7], "span": 9216}],
            "peer_verified": True,
        },
        "checks": [
            {"name": "boot", "status": "pass", "evidence": {"ready_s": 1.25}, "seconds": 1.5},
            {"name": "capture", "status": "skip", "seconds": 0.0, "reason": "no CUDA on a CPU target"},
        ],
        "faults": {"restart_count": 0, "xid_watch": "not_applicable", "xid_watch_reason": "no NVIDIA GPU"},
        "verdict": "qualified",
        "target": "cpu",
        "host": {"hostname": "node-1", "os": "Debian 12", "kernel": "6.1.0"},
        "versions": {"python": "3.11.9", "torch": "2.13.0"},
        "started_at": "2025-03-01T10:00:00Z",
        "finished_at": "2025-03-01T10:00:42.5Z",
        "qualify_version": "0.1.0",
    }
    base.update(overrides)
    return base


def subjects() -> list[Subject]:
    return [
        Subject(name="engine-code", digest={"sha256": "ab" * 32}),
        Subject(name="engine-config", digest={"sha256": config_digest(CONFIG).removeprefix("sha256:")}),
    ]


def statement() -> Statement:
    return build_statement(QualificationPredicate.model_validate(predicate_dict()), subjects())


# --------------------------------------------------------------------------- canonical JSON


def test_canonical_json_is_rfc8785_and_independent_of_key_order() -> None:
    a = {"b": [1, 2.5, "x"], "a": {"z": None, "y": True}}
    b = {"a": {"y": True, "z": None}, "b": [1, 2.5, "x"]}
    assert canonical_json(a) == canonical_json(b) == b'{"a":{"y":true,"z":null},"b":[1,2.5,"x"]}'
    assert sha256_hex(a) == hashlib.sha256(canonical_json(b)).hexdigest()
    assert digest(a) == {"sha256": sha256_hex(b)}


def test_integers_beyond_2_pow_53_become_strings_at_any_depth() -> None:
    limit = 2**53 - 1
    value = {"ok": limit, "neg_ok": -limit, "big": limit + 1, "nested": [{"neg": -(limit + 1)}], "flag": True}
    assert json.loads(canonical_json(value)) == {
        "ok": limit,
        "neg_ok": -limit,
        "big": str(limit + 1),
        "nested": [{"neg": str(-(limit + 1))}],
        "flag": True,
    }


def test_values_json_cannot_carry_are_refused() -> None:
    with pytest.raises(rfc8785.CanonicalizationError):
        canonical_json({"x": float("nan")})
    with pytest.raises(ValueError):
        canonical_json({1: "non-string key"})


# --------------------------------------------------------------------------- statement


def test_statement_round_trips_through_canonical_bytes() -> None:
    st = statement()
    payload = statement_bytes(st)
    again = parse_statement(payload)
    assert again == st
    assert statement_bytes(again) == payload
    assert isinstance(again.qualification, QualificationPredicate)
    assert again.qualification.layout is not None and again.qualification.layout.ratios == [4, 4, 4, 1]


def test_statement_serialises_in_toto_field_names_and_utc_z_times() -> None:
    data = json.loads(statement_bytes(statement()))
    assert data["_type"] == "https://in-toto.io/Statement/v1"
    assert data["predicateType"] == PREDICATE_TYPE
    assert data["subject"][0] == {"name": "engine-code", "digest": {"sha256": "ab" * 32}}
    assert data["predicate"]["started_at"] == "2025-03-01T10:00:00Z"
    assert data["predicate"]["finished_at"] == "2025-03-01T10:00:42.500000Z"
    assert "type_" not in data


def test_timestamps_with_offsets_are_stored_in_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    pred = QualificationPredicate.model_validate(
        predicate_dict(
            started_at=datetime(2025, 3, 1, 12, 0, tzinfo=plus_two),
            finished_at=datetime(2025, 3, 1, 10, 1, tzinfo=UTC),
        )
    )
    assert pred.started_at == datetime(2025, 3, 1, 10, 0, tzinfo=UTC)
    assert pred.model_dump(mode="json")["started_at"] == "2025-03-01T10:00:00Z"


def test_naive_timestamps_are_refused() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        QualificationPredicate.model_validate(predicate_dict(started_at="2025-03-01T10:00:00"))


def test_canonical_bytes_do_not_depend_on_input_key_order() -> None:
    forward = predicate_dict()
    backward = {key: forward[key] for key in reversed(list(forward))}
    backward["engine"] = {key: forward["engine"][key] for key in reversed(list(forward["engine"]))}
    one = build_statement(QualificationPredicate.model_validate(forward), subjects())
    two = build_statement(QualificationPredicate.model_validate(backward), subjects())
    assert statement_bytes(one) == statement_bytes(two)
    assert statement_bytes(one) == rfc8785.dumps(json.loads(statement_bytes(one)))


def test_big_integers_in_evidence_travel_as_strings_and_bytes_are_stable() -> None:
    big = 2**64 + 7
    checks = [{"name": "arenas", "status": "pass", "evidence": {"address": big}, "seconds": 0.1}]
    st = build_statement(QualificationPredicate.model_validate(predicate_dict(checks=checks)), subjects())
    payload = statement_bytes(st)
    assert f'"address":"{big}"'.encode() in payload
    again = parse_statement(payload)
    assert again.qualification.checks[0].evidence["address"] == str(big)
    assert statement_bytes(again) == payload


def test_signed_statement_verifies_and_parses_back() -> None:
    key = keys.generate()
    st = statement()
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, statement_bytes(st), key)
    assert parse_statement(dsse.verify(env, [key.public_key()])) == st


def test_foreign_predicate_types_keep_their_predicate_as_given() -> None:
    foreign = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "x", "digest": {"sha256": "cd" * 32}}],
        "predicateType": "https://slsa.dev/provenance/v1",
        "predicate": predicate_dict(),  # even when it happens to look like ours
    }
    st = parse_statement(json.dumps(foreign).encode())
    assert isinstance(st.predicate, dict)
    assert json.loads(statement_bytes(st)) == json.loads(canonical_json(foreign))
    with pytest.raises(VerificationError, match="not a qualification"):
        _ = st.qualification


# --------------------------------------------------------------------------- refusals


def _with(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value
    return data


@pytest.mark.parametrize(
    "path, value, where",
    [
        ("predicate.verdict", "approved", "predicate.verdict"),
        ("predicate.target", "tpu", "predicate.target"),
        ("predicate.surprise", 1, "predicate.surprise"),
        ("predicate.faults.surprise", 1, "predicate.faults.surprise"),
        ("predicate.checks.0.status", "ok", "predicate.checks.0.status"),
        ("predicate.faults.restart_count", -1, "predicate.faults.restart_count"),
        ("predicate.request.spec", "mtp:0", "predicate.request.spec"),
        ("predicate.engine.config_digest", "sha256:" + "0" * 64, "config_digest"),
        ("_type", "https://in-toto.io/Statement/v0.1", "_type"),
        ("subject", [], "subject"),
        ("extra", "field", "extra"),
        ("subject.0.digest", {"sha256": "XYZ"}, "sha256 digest must be 64"),
    ],
)
def test_invalid_statements_are_refused_naming_the_field(path: str, value: Any, where: str) -> None:
    data = _with(json.loads(statement_bytes(statement())), path, value)
    with pytest.raises(VerificationError) as err:
        parse_statement(json.dumps(data).encode())
    message = str(err.value)
    assert where in message and "\n" not in message


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xff", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"_type": "a", "_type": "b"}', "duplicate key"),
        (b'{"x": NaN}', "NaN is not JSON"),
    ],
)
def test_payloads_that_are_not_one_json_object_are_refused(payload: bytes, message: str) -> None:
    with pytest.raises(VerificationError, match=message):
        parse_statement(payload)


def test_qualified_verdict_with_a_failed_check_is_refused() -> None:
    checks = [{"name": "boot", "status": "fail", "seconds": 3.0, "reason": "engine exited"}]
    with pytest.raises(ValidationError, match="verdict qualified"):
        QualificationPredicate.model_validate(predicate_dict(checks=checks))
    rejected = QualificationPredicate.model_validate(predicate_dict(checks=checks, verdict="rejected"))
    assert rejected.checks[0].reason == "engine exited"


def test_aborted_receipt_may_lack_what_the_run_never_reached() -> None:
    pred = QualificationPredicate.model_validate(
        predicate_dict(backend=None, layout=None, checks=[], verdict="aborted")
    )
    assert pred.backend is None and pred.layout is None


def test_engine_without_any_identity_digest_is_refused() -> None:
    engine = {"name": "e", "config_digest": config_digest(CONFIG), "config": CONFIG}
    with pytest.raises(ValidationError, match="image_digest"):
        QualificationPredicate.model_validate(predicate_dict(engine=engine))


def test_finish_before_start_and_repeated_check_names_are_refused() -> None:
    with pytest.raises(ValidationError, match="before started_at"):
        QualificationPredicate.model_validate(predicate_dict(finished_at="2025-03-01T09:00:00Z"))
    twice = [{"name": "boot", "status": "pass", "seconds": 1.0}] * 2
    with pytest.raises(ValidationError, match="repeat"):
        QualificationPredicate.model_validate(predicate_dict(checks=twice))


# --------------------------------------------------------------------------- JSON Schema


def test_predicate_schema_is_valid_json_schema_with_the_verdict_enum() -> None:
    schema = predicate_json_schema()
    jsonschema_rs.meta.validate(schema)
    assert schema["$id"] == PREDICATE_TYPE
    assert schema["properties"]["verdict"]["enum"] == ["qualified", "rejected", "aborted"]
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid(json.loads(statement_bytes(statement()))["predicate"])
    assert not validator.is_valid(predicate_dict(verdict="approved"))


def test_statement_schema_accepts_a_receipt_and_applies_our_predicate_schema() -> None:
    schema = statement_json_schema()
    jsonschema_rs.meta.validate(schema)
    validator = jsonschema_rs.validator_for(schema)
    good = json.loads(statement_bytes(statement()))
    assert validator.is_valid(good)
    assert not validator.is_valid(_with(good, "predicate.verdict", "approved"))
    assert not validator.is_valid(_with(good, "_type", "wrong"))
    # The same odd predicate is fine under another predicate type.
    other = _with(_with(good, "predicate.verdict", "approved"), "predicateType", "https://example.com/x")
    assert validator.is_valid(other)


@pytest.mark.parametrize(
    ("faults", "named"),
    [
        ({"restart_count": 1}, "engine restarted 1 time(s)"),
        ({"engine_dead": True}, "engine dead"),
        ({"stop_exit_code": 1}, "exited with status 1 when stopped"),
    ],
)
def test_a_qualified_receipt_whose_faults_block_blocks_is_refused(faults: dict[str, Any], named: str) -> None:
    block = {"xid_watch": "not_applicable", "xid_watch_reason": "no NVIDIA GPU", **faults}
    with pytest.raises(ValidationError, match="disagrees with the faults block"):
        QualificationPredicate.model_validate(predicate_dict(faults=block))
    payload = canonical_json(
        {**statement().to_json(), "predicate": predicate_dict(faults=block)}
    )  # the same receipt as signed bytes: parse_statement refuses it too, naming the fault
    with pytest.raises(VerificationError, match=re.escape(named)):
        parse_statement(payload)
    assert QualificationPredicate.model_validate(predicate_dict(faults=block, verdict="rejected"))


@pytest.mark.parametrize("code", [None, 0, -15, 143, -9, 137])
def test_an_engine_that_died_of_the_stop_signal_stopped_cleanly(code: int | None) -> None:
    block = {"xid_watch": "not_applicable", "stop_exit_code": code}
    assert QualificationPredicate.model_validate(predicate_dict(faults=block)).verdict == "qualified"


def test_a_replayed_kernel_log_qualifies_a_cpu_target_but_never_a_gpu_one() -> None:
    block = {"xid_watch": "replayed", "xid_watch_reason": "kernel log replayed from file:x"}
    assert QualificationPredicate.model_validate(predicate_dict(faults=block)).faults.blocking("cpu") == []
    gpu = predicate_dict(faults=block, target="gpu", checks=[predicate_dict()["checks"][0]])
    with pytest.raises(ValidationError, match="Xid watch replayed on a gpu target"):
        QualificationPredicate.model_validate(gpu)


def test_a_lost_xid_watch_records_when_in_utc() -> None:
    block = {"xid_watch": "unavailable", "xid_watch_lost_at": "2026-12-01T15:00:00+01:00"}
    pred = QualificationPredicate.model_validate(predicate_dict(faults=block, verdict="rejected"))
    assert pred.model_dump(mode="json")["faults"]["xid_watch_lost_at"] == "2026-12-01T14:00:00Z"
