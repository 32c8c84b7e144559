"""Offline verification with no store, as rekor-cli verify / cosign verify-blob do it: `qualify verify-proof`
checks what `receipts prove` wrote against the envelope's exact bytes, the log's vkey and the operator's
public key; `qualify log consistency --out` and `qualify verify-consistency` prove that the log only grew
since a kept checkpoint. Every mutation is refused with exit 1."""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from receipts.checkpoint import NoteSigner
from receipts.keys import SigningKey, generate
from receipts.testing import synthetic_envelope


def _setup(cli, home: Path, tmp_path: Path) -> dict[str, Path | str]:
    assert cli("keys", "generate").code == 0
    key = SigningKey.load(home / "keys" / "operator.key")
    src = tmp_path / "in.json"
    src.write_text(json.dumps(synthetic_envelope(key, 1)))
    rid = json.loads(cli("receipts", "import", str(src), "--json").out)[0]["id"]
    files = {
        "vkey": tmp_path / "log.vkey",
        "cp": tmp_path / "cp.txt",
        "proof": tmp_path / "proof.txt",
        "env": tmp_path / "env.json",
        "pub": tmp_path / "operator.pub",
    }
    files["vkey"].write_text(cli("log", "vkey").out)
    assert cli("log", "checkpoint", "--out", str(files["cp"])).code == 0
    assert cli("receipts", "prove", rid, "--out", str(files["proof"])).code == 0
    files["env"].write_bytes(cli("receipts", "show", rid, "--envelope").out.encode())
    files["pub"].write_text(cli("keys", "export-public").out)
    return {**files, "rid": rid, "key": key}


def test_verify_proof_needs_no_store_and_checks_inclusion_and_signature(cli, home, tmp_path) -> None:
    f = _setup(cli, home, tmp_path)
    (home / "qualify.db").rename(tmp_path / "elsewhere.db")  # no store to lean on
    args = [str(f["proof"]), "--envelope", str(f["env"]), "--vkey", str(f["vkey"])]
    ok = cli("verify-proof", *args, "--key", str(f["pub"]), "--json")
    assert ok.code == 0, ok.err
    data = json.loads(ok.out)
    assert data["verified"] and data["log_index"] == 1 and data["signature"] and data["tree_size"] >= 2
    unsigned = cli("verify-proof", *args)
    assert unsigned.code == 0 and unsigned.out.startswith("OK: the envelope is entry 1 of log")
    assert "signature not checked" in unsigned.out
    assert not (home / "qualify.db").exists()


def test_every_mutation_is_refused(cli, home, tmp_path) -> None:
    f = _setup(cli, home, tmp_path)
    env = f["env"].read_bytes()
    base = ["--vkey", str(f["vkey"])]
    # One byte of the envelope changed: its leaf is not the one proven.
    flipped = tmp_path / "flipped.json"
    flipped.write_bytes(env.replace(b'"payloadType"', b'"payloadtype"', 1))
    r = cli("verify-proof", str(f["proof"]), "--envelope", str(flipped), *base)
    assert r.code == 1 and r.err.startswith("FAILED:")
    # A trailing newline is another leaf too: the exact stored bytes are what the log proves.
    nl = tmp_path / "nl.json"
    nl.write_bytes(env + b"\n")
    assert cli("verify-proof", str(f["proof"]), "--envelope", str(nl), *base).code == 1
    # Another log's key: the checkpoint's signature does not verify.
    other = tmp_path / "other.vkey"
    other.write_text(NoteSigner("qualify.test/other", Ed25519PrivateKey.generate()).verifier().vkey())
    r = cli("verify-proof", str(f["proof"]), "--envelope", str(f["env"]), "--vkey", str(other))
    assert r.code == 1 and r.err.startswith("FAILED:")
    # A proof with one hash changed.
    text = f["proof"].read_text().split("\n")
    i = next(n for n, line in enumerate(text) if line.startswith("index ")) + 1
    text[i] = ("B" if text[i][0] != "B" else "C") + text[i][1:]
    bad = tmp_path / "bad-proof.txt"
    bad.write_text("\n".join(text))
    assert cli("verify-proof", str(bad), "--envelope", str(f["env"]), *base).code == 1
    # The right inclusion, but the signer is not the key given.
    stranger = tmp_path / "stranger.pub"
    stranger.write_bytes(generate().public_key().public_pem())
    r = cli("verify-proof", str(f["proof"]), "--envelope", str(f["env"]), *base, "--key", str(stranger))
    assert r.code == 1 and "no signature" in r.err


def test_a_consistency_proof_is_written_with_the_store_and_verified_without_it(cli, home, tmp_path) -> None:
    f = _setup(cli, home, tmp_path)
    key: SigningKey = f["key"]  # type: ignore[assignment]
    more = tmp_path / "more.json"
    more.write_text("\n".join(json.dumps(synthetic_envelope(key, i)) for i in (2, 3)))
    assert cli("receipts", "import", str(more)).code == 0
    out = tmp_path / "consistency.json"
    made = cli("log", "consistency", str(f["cp"]), "--out", str(out), "--vkey", str(f["vkey"]), "--json")
    assert made.code == 0, made.err
    assert json.loads(made.out)["new_size"] > json.loads(made.out)["old_size"]
    (home / "qualify.db").rename(tmp_path / "elsewhere.db")
    ok = cli("verify-consistency", str(out), "--vkey", str(f["vkey"]))
    assert ok.code == 0 and ok.out.startswith("OK: log ") and "extends its checkpoint" in ok.out
    doc = json.loads(out.read_text())
    doc["hashes"][0] = ("0" if doc["hashes"][0][0] != "0" else "1") + doc["hashes"][0][1:]
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(doc))
    r = cli("verify-consistency", str(tampered), "--vkey", str(f["vkey"]))
    assert r.code == 1 and r.err.startswith("FAILED:")
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    r = cli("verify-consistency", str(junk), "--vkey", str(f["vkey"]))
    assert r.code == 2 and r.err.count("\n") == 1
