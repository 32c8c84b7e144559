"""The read API: schemathesis against its own OpenAPI document (no 5xx, responses match the schema), the
bearer token on POST /v1/decisions (401 and nothing written without it), pagination limits and proofs."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

from qualify.api import create_app
from receipts import merkle
from receipts.checkpoint import open_checkpoint, verify_tlog_proof

from .conftest import OTHER_SUBJECT, SUBJECT, Log

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLICY = {"verdict": "qualified", "conditions": {"no-restarts": "receipt.faults.restart_count == 0"}}


@pytest.fixture
def populated(make_log: Callable[[], Log]) -> Log:
    log = make_log()
    log.add(host="node-a")
    log.add(host="node-b", restarts=2)
    log.add(subject=OTHER_SUBJECT, verdict="rejected", failed_check="layout")
    return log


@pytest.fixture
def client(populated: Log) -> TestClient:
    return TestClient(create_app(populated.store, token=TOKEN, signing_key=populated.key))


@pytest.fixture
def api_app(populated: Log):
    return create_app(populated.store, token=TOKEN, signing_key=populated.key)


OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/v1/receipts"),
    ("GET", "/v1/receipts/{receipt_id}"),
    ("GET", "/v1/receipts/{receipt_id}/envelope"),
    ("GET", "/v1/receipts/{receipt_id}/proof"),
    ("GET", "/v1/log/checkpoint"),
    ("GET", "/v1/log/consistency"),
    ("GET", "/v1/approvals"),
    ("GET", "/v1/approvals/{approval_id}"),
    ("POST", "/v1/decisions"),
]
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_api_never_fails_and_matches_its_schema(api_app, method: str, path: str) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", api_app)
    operation = schema[path][method]

    # Positive and negative examples, bounded so the suite stays fast on CI's two cores.
    @given(
        case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        | operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    )
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case) -> None:
        if method == "POST":
            case.headers = {**(case.headers or {}), **AUTH}
        case.call_and_validate(checks=CHECKS)

    run()


def test_openapi_document_describes_every_route(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {
        "/v1/receipts",
        "/v1/receipts/{receipt_id}",
        "/v1/receipts/{receipt_id}/envelope",
        "/v1/receipts/{receipt_id}/proof",
        "/v1/log/checkpoint",
        "/v1/log/consistency",
        "/v1/approvals",
        "/v1/decisions",
    } <= set(paths)
    assert "401" in paths["/v1/decisions"]["post"]["responses"]


# ---------------------------------------------------------------- auth


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}],
)
def test_decisions_without_a_valid_token_are_401_and_write_nothing(
    client: TestClient, populated: Log, headers: dict[str, str]
) -> None:
    before = populated.store.counts()
    response = client.post("/v1/decisions", json={"subject": SUBJECT, "policy": POLICY}, headers=headers)
    assert response.status_code == 401
    assert populated.store.counts() == before


def test_a_bad_body_without_a_token_is_still_401(client: TestClient) -> None:
    assert client.post("/v1/decisions", json={"nonsense": True}).status_code == 401


def test_decisions_are_refused_when_no_token_was_configured(populated: Log) -> None:
    client = TestClient(create_app(populated.store, token=None, signing_key=populated.key))
    response = client.post("/v1/decisions", json={"subject": SUBJECT, "policy": POLICY}, headers=AUTH)
    assert response.status_code == 401 and "--token-file" in response.json()["detail"]


def test_decision_with_a_token_is_evaluated_and_recorded(client: TestClient, populated: Log) -> None:
    size = populated.store.size()
    response = client.post("/v1/decisions", json={"subject": SUBJECT, "policy": POLICY}, headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["decision"] == "approved" and len(body["receipt_ids"]) == 1
    # node-b's receipt did not count: named apart from the reasons, since the build was approved anyway
    assert body["reasons"] == [] and any("no-restarts" in r for r in body["ignored"])
    assert body["log_index"] == size and populated.store.size() == size + 1
    listed = client.get("/v1/approvals", params={"subject": SUBJECT}).json()["items"]
    assert [a["id"] for a in listed] == [body["approval_id"]]


def test_decision_without_record_writes_nothing(client: TestClient, populated: Log) -> None:
    before = populated.store.counts()
    body = {"subject": SUBJECT, "policy": {**POLICY, "min_hosts": 2}, "record": False}
    response = client.post("/v1/decisions", json=body, headers=AUTH)
    assert response.json()["decision"] == "denied" and response.json()["approval_id"] is None
    assert populated.store.counts() == before


def test_a_policy_that_does_not_compile_is_400_with_its_column(client: TestClient) -> None:
    body = {"subject": SUBJECT, "policy": {"conditions": {"x": "receipt.faults.restart_count =="}}}
    response = client.post("/v1/decisions", json=body, headers=AUTH)
    assert response.status_code == 400
    assert "condition 'x' does not compile" in response.json()["detail"]
    assert "column" in response.json()["detail"]


# ---------------------------------------------------------------- reading


def test_pagination_walks_every_receipt_once(client: TestClient) -> None:
    seen, offset = [], 0
    while offset is not None:
        page = client.get("/v1/receipts", params={"limit": 1, "offset": offset}).json()
        seen += [r["log_index"] for r in page["items"]]
        offset = page["next_offset"]
    assert seen == sorted(seen, reverse=True) and len(seen) == 3  # newest first, as the CLI lists


@pytest.mark.parametrize(
    "params", [{"limit": 0}, {"limit": 501}, {"offset": -1}, {"limit": "ten"}, {"verdict": "passed"}]
)
def test_pagination_and_filters_are_validated(client: TestClient, params: dict) -> None:
    assert client.get("/v1/receipts", params=params).status_code == 422


def test_limit_of_500_is_accepted(client: TestClient) -> None:
    page = client.get("/v1/receipts", params={"limit": 500}).json()
    assert page["limit"] == 500 and page["next_offset"] is None and len(page["items"]) == 3


def test_filters_select_by_verdict_subject_and_time(client: TestClient) -> None:
    # node-b restarted (rejected by its faults) and the other subject's layout failed
    assert len(client.get("/v1/receipts", params={"verdict": "rejected"}).json()["items"]) == 2
    assert len(client.get("/v1/receipts", params={"subject": SUBJECT}).json()["items"]) == 2
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    assert client.get("/v1/receipts", params={"since": future}).json()["items"] == []


def test_receipt_envelope_and_proof_verify_offline(client: TestClient, populated: Log) -> None:
    first = client.get("/v1/receipts").json()["items"][-1]  # the oldest: node-a
    detail = client.get(f"/v1/receipts/{first['id'][:10]}").json()
    assert detail["predicate"]["host"]["hostname"] == "node-a"
    envelope = client.get(f"/v1/receipts/{first['id']}/envelope").json()
    assert envelope["signatures"][0]["keyid"] == populated.key.keyid
    proof = client.get(f"/v1/receipts/{first['id']}/proof").json()
    leaf = bytes.fromhex(proof["leaf_hash"])
    verifier = populated.store.log_verifier()
    _, cp = verify_tlog_proof(proof["tlog_proof"], leaf, [verifier])
    assert cp.size == proof["tree_size"] == populated.store.size()
    merkle.verify_inclusion(
        proof["log_index"], proof["tree_size"], leaf, [bytes.fromhex(h) for h in proof["hashes"]], cp.root
    )


def test_proof_against_an_older_size_and_bad_sizes(client: TestClient) -> None:
    rid = client.get("/v1/receipts").json()["items"][-1]["id"]  # log #1 (newest first)
    assert client.get(f"/v1/receipts/{rid}/proof", params={"size": 2}).json()["tree_size"] == 2
    assert client.get(f"/v1/receipts/{rid}/proof", params={"size": 1}).status_code == 400
    assert client.get(f"/v1/receipts/{rid}/proof", params={"size": 99}).status_code == 400
    assert client.get(f"/v1/receipts/{'0' * 64}/proof").status_code == 404


def test_consistency_proof_links_two_signed_checkpoints(client: TestClient, populated: Log) -> None:
    latest = client.get("/v1/log/checkpoint").json()
    cp = open_checkpoint(latest["note"], [populated.store.log_verifier()])
    assert (cp.size, cp.root.hex()) == (latest["size"], latest["root_hash"])
    proof = client.get("/v1/log/consistency", params={"first": 2, "second": latest["size"]}).json()
    merkle.verify_consistency(
        2,
        latest["size"],
        [bytes.fromhex(h) for h in proof["hashes"]],
        bytes.fromhex(proof["first_root"]),
        cp.root,
    )


@pytest.mark.parametrize("params", [{"first": 0}, {"first": 3, "second": 2}, {"first": 1, "second": 99}])
def test_consistency_refuses_bad_sizes(client: TestClient, params: dict) -> None:
    assert client.get("/v1/log/consistency", params=params).status_code in (400, 422)


def test_empty_log_has_no_checkpoint(make_log: Callable[[], Log], tmp_path) -> None:
    from receipts.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        response = TestClient(create_app(store)).get("/v1/log/checkpoint")
        assert response.status_code == 404 and "empty" in response.json()["detail"]
    finally:
        store.close()


@pytest.mark.parametrize("since", ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59"])
def test_a_since_that_cannot_be_put_in_utc_is_422(client: TestClient, since: str) -> None:
    response = client.get("/v1/receipts", params={"since": since})
    assert response.status_code == 422 and "not a time that exists" in response.json()["detail"]


@pytest.mark.parametrize("since", ["-34307430", "yesterday", "1y", "99999999999d"])
def test_since_takes_the_cli_grammar_only(client: TestClient, since: str) -> None:
    response = client.get("/v1/receipts", params={"since": since})
    assert response.status_code == 422 and "\n" not in response.json()["detail"]
    for good in ("2000-01-01T00:00:00+02:00", "2000-01-01", "2000-01-01T00:00:00", "10000d"):
        assert len(client.get("/v1/receipts", params={"since": good}).json()["items"]) == 3, good


def test_the_api_and_the_cli_share_one_grammar_order_and_filters(
    client: TestClient, populated: Log, capsys
) -> None:
    from .test_cli import run

    code, out, _ = run(capsys, "receipts", "list", "--db", populated.url, "--json", "--since", "1h")
    assert code == 0
    cli = json.loads(out)
    api = client.get("/v1/receipts", params={"since": "1h"}).json()
    assert [r["id"] for r in api["items"]] == [r["id"] for r in cli["items"]]
    assert api["total"] == cli["total"] == 3
    by_host = client.get("/v1/receipts", params={"host": "node-b"}).json()["items"]
    assert by_host and {r["host"] for r in by_host} == {"node-b"}
    assert client.get("/v1/receipts", params={"host": "no-such-host"}).json()["items"] == []
    bare = client.get("/v1/receipts", params={"subject": SUBJECT.removeprefix("sha256:")}).json()
    assert len(bare["items"]) == 2


@pytest.mark.parametrize("route", ["/v1/receipts", "/v1/approvals", "/v1/log/checkpoint", "/health"])
def test_an_unknown_query_parameter_is_refused_in_one_line(client: TestClient, route: str) -> None:
    response = client.get(route, params={"hots": "node-a"})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail.startswith("unknown query parameter 'hots'") and "\n" not in detail


def test_decisions_verify_with_the_trust_given_not_the_key_the_store_names(populated: Log) -> None:
    """POST /v1/decisions checks checkpoints with the verifiers `qualify serve` hands it (the local log
    key, as `qualify approve` uses): a store whose log key is not that one approves nothing."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from receipts.checkpoint import NoteSigner

    stranger = NoteSigner(populated.store.origin, Ed25519PrivateKey.generate()).verifier()
    app = create_app(populated.store, token=TOKEN, signing_key=populated.key, verifiers=[stranger])
    body = {"subject": SUBJECT, "policy": {"min_hosts": 1}, "record": False}
    response = TestClient(app).post("/v1/decisions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    decision = response.json()
    assert decision["decision"] == "denied"
    assert all("does not verify" in note for note in decision["ignored"]) and decision["ignored"]
