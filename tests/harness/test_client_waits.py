"""The harness's client records how long it waited on each endpoint (session ids folded, a bounded
number of keys), and hands the record over once: what the pipeline files per check as
`time_waited_on_engine`."""

from __future__ import annotations

import time

import httpx

from qualify.client import MAX_WAITED_KEYS, EngineClient


def _client() -> EngineClient:
    def answer(request: httpx.Request) -> httpx.Response:
        time.sleep(0.01)
        return httpx.Response(200, json={"ok": True})

    client = EngineClient("http://engine.test")
    client._http = httpx.Client(transport=httpx.MockTransport(answer))
    return client


def test_waits_are_summed_per_endpoint_and_taken_once() -> None:
    client = _client()
    for _ in range(3):
        client._request("GET", "/health")
    client._request("POST", "/qualify/sessions/abc123/step")
    client._request("POST", "/qualify/sessions/def456/step?x=1")
    waited = client.take_waited()
    assert set(waited) == {"GET /health", "POST /qualify/sessions/{id}/step"}
    assert waited["GET /health"]["n"] == 3 and waited["GET /health"]["s"] >= 0.03
    assert waited["POST /qualify/sessions/{id}/step"]["n"] == 2
    assert client.take_waited() == {}


def test_the_record_is_bounded_whatever_paths_are_sent() -> None:
    client = _client()
    for i in range(MAX_WAITED_KEYS + 10):
        client._request("GET", f"/path/{i}")
    waited = client.take_waited()
    assert len(waited) == MAX_WAITED_KEYS + 1 and waited["other"]["n"] == 10
