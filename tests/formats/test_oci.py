"""`qualify receipts attach` and `qualify approve --from-registry` against a real registry (Debian's
docker-registry, started by the tests) holding an image pushed with docker: the receipt is stored as an
OCI 1.1 artifact referring to the image's manifest (found through the referrers tag schema, this
registry having no referrers API) and in cosign's sha256-<digest>.att tag; reading them back, only
receipts whose inclusion proof and signature verify against this log count."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from qualify import oci
from receipts import dsse, keys
from receipts.canonical import canonical_json
from receipts.checkpoint import NoteSigner
from receipts.keys import SigningKey
from receipts.sigstore_bundle import BUNDLE_MEDIA_TYPE, bundle_of
from receipts.statement import PREDICATE_TYPE
from receipts.store import Store
from receipts.testing import synthetic_statement

POLICY = 'name = "two hosts"\nverdict = "qualified"\nmin_hosts = 2\n'


def _get(url: str, accept: str) -> tuple[dict[str, Any], bytes]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=30) as answer:
        data = answer.read()
    return json.loads(data), data


@pytest.fixture
def log(cli, home: Path, tmp_path: Path) -> dict[str, Any]:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    assert cli("keys", "generate", "--algorithm", "p256", "--db", url).code == 0
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    return {"url": url, "key": SigningKey.load(home / "keys" / "operator.key"), "policy": policy}


def _receipt(cli, log: dict[str, Any], tmp_path: Path, image_id: str, host: str, n: int) -> str:
    statement = synthetic_statement(n, subject_digest=image_id.removeprefix("sha256:"))
    statement["predicate"]["host"]["hostname"] = host
    path = tmp_path / f"r{n}.json"
    path.write_text(json.dumps(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement), log["key"])))
    imported = cli("receipts", "import", path, "--db", log["url"], "--json")
    assert imported.code == 0, imported.err
    return json.loads(imported.out)[0]["id"]


def _approve(cli, log: dict[str, Any], ref: str, *extra: str):
    return cli(
        "approve", "--policy", log["policy"], "--image", ref, "--from-registry", "--db", log["url"], "--json",
        *extra,
    )  # fmt: skip


def test_attach_stores_both_forms_and_approve_reads_them_back(
    cli, log, pushed_image, registry: str, tmp_path: Path
) -> None:
    ref, image_id = pushed_image["ref"], pushed_image["image_id"]
    ids = [_receipt(cli, log, tmp_path, image_id, host, n) for n, host in enumerate(["node-a", "node-b"])]

    # Before anything is attached the registry has no receipt for the image: denied, exit 1.
    denied = _approve(cli, log, ref, "--dry-run")
    assert denied.code == 1, denied.err
    assert json.loads(denied.out)["decision"] == "denied"

    attached = cli("receipts", "attach", ids[0], "--image", ref, "--db", log["url"], "--json")
    assert attached.code == 0, attached.err
    info = json.loads(attached.out)
    assert info["image_config_digest"] == image_id and info["referrers_api"] is False
    repo = ref.split("/", 1)[1].rsplit(":", 1)[0]
    base = f"http://{registry}/v2/{repo}"

    # The OCI 1.1 form: an artifact whose subject is the image manifest, listed by the referrers tag.
    index, _ = _get(f"{base}/manifests/{info['referrers_tag']}", oci.OCI_INDEX)
    (listed,) = index["manifests"]
    assert listed["digest"] == info["referrer"] and listed["artifactType"] == BUNDLE_MEDIA_TYPE
    artifact, _ = _get(f"{base}/manifests/{info['referrer']}", oci.OCI_MANIFEST)
    assert artifact["subject"]["digest"] == info["image_digest"]
    assert [layer["mediaType"] for layer in artifact["layers"]] == [BUNDLE_MEDIA_TYPE, oci.PROOF_LAYER]
    assert artifact["annotations"][oci.PREDICATE_ANNOTATION] == PREDICATE_TYPE
    bundle, _ = _get(f"{base}/blobs/{artifact['layers'][0]['digest']}", "*/*")
    stored = cli("receipts", "show", ids[0], "--envelope", "--db", log["url"]).out.encode()
    assert bundle == bundle_of(stored)

    # cosign's tag form: sha256-<hex>.att, the exact stored envelope as a DSSE layer.
    att, _ = _get(f"{base}/manifests/{info['att_tag']}", oci.OCI_MANIFEST)
    (layer,) = att["layers"]
    assert layer["mediaType"] == "application/vnd.dsse.envelope.v1+json"
    assert layer["annotations"]["predicateType"] == PREDICATE_TYPE
    with urllib.request.urlopen(f"{base}/blobs/{layer['digest']}", timeout=30) as answer:
        assert answer.read() == stored

    # One host's receipt is not enough for this policy: denied, and the reason says why.
    one = _approve(cli, log, ref, "--dry-run")
    assert one.code == 1 and json.loads(one.out)["receipt_ids"] == [ids[0]]

    # Both attached (twice for the first: nothing is duplicated): approved, exit 0, and recorded.
    for rid in (ids[1], ids[0]):
        assert cli("receipts", "attach", rid, "--image", ref, "--db", log["url"]).code == 0
    index, _ = _get(f"{base}/manifests/{info['referrers_tag']}", oci.OCI_INDEX)
    assert len(index["manifests"]) == 2
    approved = _approve(cli, log, ref)
    assert approved.code == 0, approved.out + approved.err
    decision = json.loads(approved.out)
    assert decision["decision"] == "approved" and sorted(decision["receipt_ids"]) == sorted(ids)
    assert decision["subject"] == image_id and decision["approval_id"]
    _, found = oci.read_back(ref)
    assert {a.receipt_id for a in found} == set(ids)
    assert all(len(a.found_in) == 2 and "att tag" in a.found_in for a in found)  # both forms, once each


def test_receipts_that_do_not_verify_against_this_log_do_not_count(
    cli, log, pushed_image, tmp_path: Path
) -> None:
    """A registry is not trusted: an attached receipt counts only if its tlog-proof verifies under this
    log's checkpoint key and a key this log trusts signed it at its index."""
    ref, image_id = pushed_image["ref"], pushed_image["image_id"]
    good = _receipt(cli, log, tmp_path, image_id, "node-a", 1)
    assert cli("receipts", "attach", good, "--image", ref, "--db", log["url"]).code == 0

    # Another log (its own log key and operator key) qualified the same image on node-b; its receipt,
    # with its own valid proof, is attached too.
    other = Store.open(f"sqlite:///{tmp_path / 'other.db'}", log_signer=NoteSigner("other/log", _ed25519()))
    stranger = keys.generate("p256")
    other.trust_key(stranger.public_key())
    statement = synthetic_statement(2, subject_digest=image_id.removeprefix("sha256:"))
    statement["predicate"]["host"]["hostname"] = "node-b"
    record = other.append_receipt(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, canonical_json(statement), stranger))
    from qualify.commands.receipts import inclusion_of

    proof, _ = inclusion_of(other, other.get_receipt(record.id))
    envelope = other.entry(record.log_idx).envelope
    other.close()
    oci.attach(ref, bundle=bundle_of(envelope), proof=proof, predicate_type=PREDICATE_TYPE)

    decided = _approve(cli, log, ref, "--dry-run")
    assert decided.code == 1, decided.out + decided.err
    decision = json.loads(decided.out)
    assert decision["receipt_ids"] == [good]
    (note,) = [n for n in decision["ignored"] if record.id[:12] in n]
    assert "found in" in note, note


def _ed25519():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def test_attach_refuses_a_receipt_about_another_image_and_bad_references(
    cli, log, pushed_image, tmp_path: Path
) -> None:
    ref = pushed_image["ref"]
    other = _receipt(cli, log, tmp_path, "sha256:" + "ab" * 32, "node-a", 3)
    refused = cli("receipts", "attach", other, "--image", ref, "--db", log["url"])
    assert refused.code == 2 and "is not about" in refused.err and len(refused.err.strip().splitlines()) == 1
    no_registry = cli("approve", "--policy", log["policy"], "--from-registry", "--db", log["url"])
    assert no_registry.code == 2 and "--image" in no_registry.err
    with socket.socket() as s:  # a port where nothing listens: could not decide, exit 2
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}/x/y:z"
    unreachable = _approve(cli, log, dead, "--dry-run")
    assert unreachable.code == 2 and "did not answer" in unreachable.err, unreachable.err


def test_read_back_reads_no_more_than_its_limits(cli, log, pushed_image, tmp_path, monkeypatch) -> None:
    ref, image_id = pushed_image["ref"], pushed_image["image_id"]
    rid = _receipt(cli, log, tmp_path, image_id, "node-a", 5)
    assert cli("receipts", "attach", rid, "--image", ref, "--db", log["url"]).code == 0
    monkeypatch.setattr(oci, "MAX_BLOB_BYTES", 100)  # the bundle is a few KiB
    with pytest.raises(oci.UsageError, match="over 100 bytes; not read"):
        oci.read_back(ref)
    refused = _approve(cli, log, ref, "--dry-run")
    assert refused.code == 2 and "over 100 bytes" in refused.err  # could not decide, said in one line
