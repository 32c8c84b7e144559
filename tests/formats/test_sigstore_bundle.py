"""`qualify receipts bundle`: a Sigstore bundle v0.3 that sigstore-js (`@sigstore/verify`, from the npm
registry) verifies against the operator's public key named by its hint, for Ed25519 and P-256 keys; the
bundle's envelope is the stored one byte for byte, and the log inclusion beside it verifies offline."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from receipts import dsse, keys
from receipts.canonical import canonical_json
from receipts.errors import VerificationError
from receipts.sigstore_bundle import BUNDLE_MEDIA_TYPE, bundle_of, envelope_from_bundle


@pytest.mark.parametrize("algorithm", ["ed25519", "p256"])
def test_the_bundle_verifies_with_sigstore_js_against_the_operator_key(
    cli, receipt_store, sigstore_js, tmp_path: Path, algorithm: str
) -> None:
    made = receipt_store(algorithm)
    out = tmp_path / "receipt.sigstore.json"
    wrote = cli("receipts", "bundle", made["id"][:12], "--out", out, "--db", made["url"], "--json")
    assert wrote.code == 0, wrote.err
    info = json.loads(wrote.out)
    assert info["tlog_proof"] == str(tmp_path / "receipt.tlog-proof")
    bundle = json.loads(out.read_text())
    assert bundle["mediaType"] == BUNDLE_MEDIA_TYPE == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert bundle["verificationMaterial"]["publicKey"]["hint"] == made["key"].keyid == info["keyid"]
    assert len(bundle["dsseEnvelope"]["signatures"]) == 1

    result = sigstore_js.verify(out, made["public"], made["key"].keyid)
    assert result["ok"], result
    assert result["predicateType"] == "https://qualify.dev/qualification/v1"

    # The exact stored bytes: the bundle's envelope is the logged leaf.
    stored = cli("receipts", "show", made["id"], "--envelope", "--db", made["url"]).out.encode()
    assert envelope_from_bundle(bundle) == stored

    # The log inclusion beside it verifies offline, from the bundle alone plus the log's vkey.
    vkey = cli("log", "vkey", "--db", made["url"]).out.strip()
    proof = tmp_path / "receipt.tlog-proof"
    checked = cli("verify-proof", proof, "--bundle", out, "--vkey", vkey, "--key", made["public"], "--json")
    assert checked.code == 0, checked.out + checked.err
    assert json.loads(checked.out)["verified"] is True


def test_sigstore_js_refuses_a_changed_payload_another_key_and_a_wrong_hint(
    receipt_store, sigstore_js, tmp_path: Path, cli
) -> None:
    made = receipt_store("p256")
    out = tmp_path / "r.sigstore.json"
    assert cli("receipts", "bundle", made["id"], "--out", out, "--db", made["url"]).code == 0
    bundle = json.loads(out.read_text())

    changed = json.loads(json.dumps(bundle))
    statement = json.loads(base64.b64decode(changed["dsseEnvelope"]["payload"]))
    statement["predicate"]["verdict"] = (
        "qualified" if statement["predicate"]["verdict"] != "qualified" else "x"
    )
    changed["dsseEnvelope"]["payload"] = base64.b64encode(canonical_json(statement)).decode()
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(changed))
    refused = sigstore_js.verify(edited, made["public"], made["key"].keyid)
    assert not refused["ok"] and "SIGNATURE" in refused["error"]

    other = keys.generate("p256")
    other_pem = tmp_path / "other.pub"
    other_pem.write_bytes(other.public_key().public_pem())
    assert not sigstore_js.verify(out, other_pem, made["key"].keyid)["ok"]
    # The key is looked up by the bundle's hint: trusting it under another id finds nothing.
    assert "key not found" in sigstore_js.verify(out, made["public"], other.keyid)["error"]


def test_bundle_needs_exactly_one_signature_with_a_key_id() -> None:
    a, b = keys.generate(), keys.generate("p256")
    two = canonical_json(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, b"{}", [a, b]))
    with pytest.raises(VerificationError, match="one signature"):
        bundle_of(two)
    one = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, b"{}", a)
    one["signatures"][0]["keyid"] = ""
    with pytest.raises(VerificationError, match="no key id"):
        bundle_of(canonical_json(one))
    with pytest.raises(VerificationError, match="media type"):
        envelope_from_bundle({"mediaType": "application/vnd.dev.sigstore.bundle+json;version=0.2"})


def test_bundle_of_an_unknown_receipt_is_one_line_and_writes_nothing(cli, receipt_store, tmp_path) -> None:
    made = receipt_store("ed25519")
    out = tmp_path / "none.sigstore.json"
    result = cli("receipts", "bundle", "ffffffff", "--out", out, "--db", made["url"])
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "none.tlog-proof").exists()
