"""The log's checkpoints and proofs checked by an implementation that is not ours: the Go reference code
of c2sp.org/signed-note and tlog (golang.org/x/mod/sumdb/note and sumdb/tlog, Debian's
golang-golang-x-mod-dev), built here from tests/interop/c2spcheck. It also requires the checkpoint's key
name to equal its origin, as a witness that looks the log's key up by origin does."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from receipts.checkpoint import NoteSigner, open_checkpoint
from receipts.testing import synthetic_envelope

SOURCE = Path(__file__).parents[1] / "interop" / "c2spcheck" / "main.go"
GOPATH = Path("/usr/share/gocode")
X_MOD = GOPATH / "src" / "golang.org" / "x" / "mod" / "sumdb" / "note"


@pytest.fixture(scope="module")
def c2spcheck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None or not X_MOD.is_dir():
        pytest.skip(
            "the Go reference check needs Debian's golang-go and golang-golang-x-mod-dev "
            "(.ci/run installs them): apt-get install golang-go golang-golang-x-mod-dev"
        )
    out = tmp_path_factory.mktemp("go")
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": str(GOPATH),
        "GOCACHE": str(out / "cache"),
        "GOFLAGS": "",
    }
    subprocess.run([go, "build", "-o", str(out / "c2spcheck"), str(SOURCE)], env=env, check=True, timeout=300)
    return out / "c2spcheck"


def go_check(binary: Path, request: dict) -> dict[str, str]:
    done = subprocess.run(
        [str(binary)], input=json.dumps(request), capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _request(store, vkey: str, index: int, old_size: int) -> dict:
    note = store.latest_checkpoint()
    size = open_checkpoint(note, [store.log_verifier()]).size
    records = [_b64(e.envelope) for e in store.iter_entries()]
    return {
        "vkey": vkey,
        "note": note,
        "records": records,
        "index": index,
        "proof": [_b64(h) for h in store.inclusion_proof(index, size)],
        "old_note": store.checkpoint(old_size),
        "consistency": [_b64(h) for h in store.consistency_proof(old_size, size)],
    }


def test_a_cli_log_is_accepted_by_the_go_reference_code(c2spcheck, cli, home, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    for name in ("a", "b", "c"):
        assert cli("keys", "generate", "--db", url, "--out", tmp_path / f"{name}.key").code == 0
    vkey = cli("log", "vkey", "--db", url).out.strip()
    origin = json.loads(cli("log", "checkpoint", "--db", url, "--json").out)["origin"]
    assert vkey.split("+")[0] == origin  # key name == origin

    from receipts.store import Store

    with Store.open(url, create=False) as store:
        answer = go_check(c2spcheck, _request(store, vkey, index=1, old_size=1))
    assert answer == {
        "vkey": "ok",
        "checkpoint": "ok",
        "records": "ok",
        "inclusion": "ok",
        "consistency": "ok",
    }


def test_the_go_reference_code_refuses_what_it_should(c2spcheck, store, operator, log_signer) -> None:
    for n in range(6):
        store.append_receipt(synthetic_envelope(operator, n))
    good = _request(store, log_signer.vkey(), index=3, old_size=2)
    assert set(go_check(c2spcheck, good).values()) == {"ok"}

    altered = dict(good, proof=[good["proof"][1], good["proof"][0], *good["proof"][2:]])
    assert go_check(c2spcheck, altered)["inclusion"] != "ok"
    wrong_leaf = dict(good, index=4)
    assert go_check(c2spcheck, wrong_leaf)["inclusion"] != "ok"
    forked = dict(good, consistency=[_b64(b"\1" * 32), *good["consistency"][1:]])
    assert go_check(c2spcheck, forked)["consistency"] != "ok"
    planted = dict(good, records=[*good["records"][:-1], _b64(b"planted")])
    assert go_check(c2spcheck, planted)["records"] != "ok"

    # The same key under another name (what logs did before key name = origin) is refused by a
    # verifier that looks the key up by origin.
    renamed = NoteSigner("qualify.local/vm", log_signer.private_key)
    body = good["note"][: good["note"].rfind("\n\n") + 1]
    misnamed = dict(good, vkey=renamed.vkey(), note=renamed.sign(body.encode()), index=None)
    del misnamed["old_note"]
    assert "is not the checkpoint's origin" in go_check(c2spcheck, misnamed)["checkpoint"]


def test_notes_signed_by_go_open_here(c2spcheck) -> None:
    text = "qualify.test/go-log\n3\n" + _b64(bytes(range(32))) + "\n"
    answer = go_check(c2spcheck, {"sign": "qualify.test/go-log", "sign_text": text})
    assert answer["sign"] == "ok"
    signer = NoteSigner.from_skey(answer["skey"])
    assert signer.vkey() == answer["vkey"]
    cp = open_checkpoint(answer["signed"], [signer.verifier()], origin="qualify.test/go-log")
    assert cp.size == 3 and cp.root == bytes(range(32))
    assert signer.sign(text.encode()) == answer["signed"]  # Ed25519 is deterministic: same bytes
