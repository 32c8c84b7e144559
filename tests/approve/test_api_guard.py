"""The API's guards: the token before the body, a body cap that never reads past it, bounded JSON, one-line
422s for NaN and absurd values, and /docs that loads with no network."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from qualify.api import create_app
from qualify.limits import MAX_BODY_BYTES

from .conftest import SUBJECT, Log
from .test_api import AUTH, POLICY, TOKEN


@pytest.fixture
def populated(make_log: Callable[[], Log]) -> Log:
    log = make_log()
    log.add(host="node-a")
    return log


@pytest.fixture
def client(populated: Log) -> TestClient:
    return TestClient(create_app(populated.store, token=TOKEN, signing_key=populated.key))


def call(app: Any, headers: dict[str, str], chunks: Callable[[], bytes | None]) -> tuple[int, int]:
    """Send a POST /v1/decisions straight through ASGI, its body from `chunks` (None: the end); returns
    the status and how many body chunks the app asked for."""
    asked = 0
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        chunk = chunks()
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/decisions",
        "raw_path": b"/v1/decisions",
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    return status, asked


def endless() -> Callable[[], bytes | None]:
    """64 KiB chunks, 4 MiB in all (a bound so that code which reads everything still ends)."""
    sent = 0

    def chunk() -> bytes | None:
        nonlocal sent
        sent += 1
        return b" " * 65536 if sent <= 64 else None

    return chunk


def test_a_request_without_the_token_is_refused_before_its_body_is_read(populated: Log) -> None:
    app = create_app(populated.store, token=TOKEN, signing_key=populated.key)
    status, asked = call(app, {"content-type": "application/json"}, endless())
    assert (status, asked) == (401, 0)


def test_a_declared_oversized_body_is_413_without_reading_it(populated: Log) -> None:
    app = create_app(populated.store, token=TOKEN, signing_key=populated.key)
    headers = {**AUTH, "content-type": "application/json", "content-length": str(200 << 20)}
    assert call(app, headers, endless()) == (413, 0)


def test_a_streamed_body_is_cut_off_once_past_the_cap(populated: Log) -> None:
    before = populated.store.counts()
    app = create_app(populated.store, token=TOKEN, signing_key=populated.key)
    status, asked = call(app, {**AUTH, "content-type": "application/json"}, endless())
    assert status == 413
    assert asked == MAX_BODY_BYTES // 65536 + 1  # stopped at the first chunk past 1 MiB
    assert populated.store.counts() == before


def test_a_body_under_the_cap_is_still_judged(client: TestClient) -> None:
    body = {"subject": SUBJECT, "policy": {**POLICY, "name": "x" * 150}, "record": False}
    assert client.post("/v1/decisions", json=body, headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"subject": "%s", "policy": {"min_hosts": NaN}}', "NaN"),
        ('{"subject": "%s", "policy": {"verdict": "qualified"}, "record": Infinity}', "Infinity"),
        ('{"subject": "%s", "policy": {"name": ' + "[" * 5000 + "]" * 5000 + "}}", "nested more than 64"),
        ('{"subject": "%s", "policy": {"name": ' + "[" * 100 + "]" * 100 + "}}", "nested more than 64"),
        ('{"subject": "%s", "policy": {"min_hosts": ' + "9" * 5000 + "}}", "digits"),
        ('{"subject": "%s", "policy": {"max_age": "1000000000d"}}', "longer than 3650d"),
        ('{"subject": "%s", "policy": {"min_hosts": 2.5}}', "min_hosts"),
    ],
    ids=["nan", "infinity", "very-deep", "deep", "long-integer", "max-age", "float"],
)
def test_hostile_bodies_are_one_line_422s(client: TestClient, populated: Log, raw: str, message: str) -> None:
    before = populated.store.counts()
    response = client.post(
        "/v1/decisions", content=raw % SUBJECT, headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and message in detail
    assert populated.store.counts() == before


def test_an_empty_policy_is_refused(client: TestClient, populated: Log) -> None:
    before = populated.store.counts()
    response = client.post("/v1/decisions", json={"subject": SUBJECT, "policy": {}}, headers=AUTH)
    assert response.status_code == 400 and "states no requirement" in response.json()["detail"]
    assert populated.store.counts() == before


def test_a_policy_over_the_cost_bound_is_refused(client: TestClient) -> None:
    slow = "receipt.checks.all(a, receipt.checks.all(b, receipt.checks.all(c, true)))"
    body = {"subject": SUBJECT, "policy": {"conditions": {"slow": slow}}, "record": False}
    response = client.post("/v1/decisions", json=body, headers=AUTH)
    assert response.status_code == 400 and "3 deep" in response.json()["detail"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_their_assets_from_this_server(client: TestClient, page: str) -> None:
    html = client.get(page).text
    external = re.findall(r"""(?:src|href)\s*=\s*["'](https?:)?//""", html)
    assert external == [], html
    assets = re.findall(r"""["'](/static-offline-docs/[^"']+)["']""", html)
    assert assets
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200 and len(response.content) > 100, asset
