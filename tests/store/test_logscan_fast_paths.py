"""The verification fast paths (envelope parse, checkpoint notes as the log writes them) accept exactly
what the general paths accept, and anything else is still judged by the general paths."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from receipts import dsse, keys, logscan
from receipts.checkpoint import Checkpoint, NoteSigner, sign_checkpoint
from receipts.errors import ReceiptsError, TamperError
from receipts.testing import append_synthetic, synthetic_envelope
from receipts.verify import verify_log

ORIGIN = "qualify.test/log"
ROOT = bytes(range(32))


def _variants(envelope: dict) -> list[object]:
    sig = envelope["signatures"][0]
    unpadded = envelope["payload"].rstrip("=")
    return [
        json.dumps(envelope).encode(),
        json.dumps({**envelope, "payload": envelope["payload"].replace("+", "-").replace("/", "_")}).encode(),
        json.dumps({**envelope, "payload": unpadded}).encode(),
        json.dumps({**envelope, "signatures": [{"sig": sig["sig"]}]}).encode(),
        json.dumps({**envelope, "signatures": [sig, {"keyid": "b" * 64, "sig": sig["sig"]}]}).encode(),
        json.dumps({**envelope, "extra": 1}).encode(),
        json.dumps({**envelope, "signatures": []}).encode(),
        json.dumps({**envelope, "signatures": [{"keyid": 5, "sig": sig["sig"]}]}).encode(),
        json.dumps({**envelope, "payload": envelope["payload"][:-2] + "é="}).encode(),
        json.dumps({**envelope, "payload": "a$bc"}).encode(),
        json.dumps({**envelope, "payloadType": ""}).encode(),
        json.dumps([envelope]).encode(),
        b"{not json",
        b"\xff\xfe",
    ]


@pytest.mark.parametrize("number", range(14))
def test_the_envelope_fast_path_decodes_exactly_what_dsse_parse_decodes(number: int) -> None:
    envelope = synthetic_envelope(keys.generate(), 3)
    data = _variants(envelope)[number]
    try:
        expected: object = dsse.parse(data)
    except ReceiptsError as error:
        expected = str(error)
    try:
        got: object = logscan._envelope(data)
    except ReceiptsError as error:
        got = str(error)
    assert got == expected


def _notes(signer: NoteSigner, seeded: bool = False, origin: str | None = ORIGIN) -> logscan._Notes:
    seed = signer.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    if seeded:
        return logscan._Notes(logscan.LogKeys((signer.vkey(),), origin, signer.name, seed))
    return logscan._Notes(logscan.LogKeys((signer.vkey(),), origin))


@pytest.mark.parametrize("seeded", [False, True])
def test_a_note_as_the_log_writes_it_gives_its_root(seeded: bool) -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), signer)
    assert _notes(signer, seeded).root(7, note, ROOT) == (ROOT, None)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_note_with_a_witness_line_is_still_accepted_by_the_general_path(seeded: bool) -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    witness = NoteSigner("witness.example/w", Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), signer)
    cosigned = note + witness.sign(Checkpoint(ORIGIN, 7, ROOT).body()).split("\n\n", 1)[1]
    assert _notes(signer, seeded).root(7, cosigned, ROOT) == (ROOT, None)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_note_by_another_key_of_the_same_name_is_refused(seeded: bool) -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    other = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), other)
    root, problem = _notes(signer, seeded).root(7, note, ROOT)
    assert root is None and "does not verify" in (problem or "")


@pytest.mark.parametrize("seeded", [False, True])
def test_a_flipped_signature_bit_in_a_canonical_note_is_refused(seeded: bool) -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), signer)
    head, line = note[:-1].rsplit(" ", 1)
    blob = bytearray(base64.b64decode(line))
    blob[10] ^= 1
    forged = f"{head} {base64.b64encode(bytes(blob)).decode()}\n"
    root, problem = _notes(signer, seeded).root(7, forged, ROOT)
    assert root is None and "invalid signature" in (problem or "")


def test_a_root_column_that_differs_from_the_note_is_named() -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), signer)
    root, problem = _notes(signer).root(7, note, bytes(32))
    assert root == ROOT and problem == "checkpoint 7: the root column differs from the signed note"


def test_a_note_stored_under_another_size_is_named() -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), signer)
    root, problem = _notes(signer).root(8, note, ROOT)
    assert problem == "the checkpoint note says size 7 but is stored as size 8"


def test_a_note_for_another_origin_is_refused() -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint("other.test/log", 7, ROOT), signer)
    root, problem = _notes(signer).root(7, note, ROOT)
    assert root is None and "other.test/log" in (problem or "")


def test_a_note_with_a_non_canonical_base64_signature_is_refused() -> None:
    signer = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    note = sign_checkpoint(Checkpoint(ORIGIN, 7, ROOT), signer)
    mangled = note[:-1] + "\n"  # unchanged control
    assert _notes(signer).root(7, mangled, ROOT) == (ROOT, None)
    head, line = note[:-1].rsplit(" ", 1)
    unpadded = f"{head} {line.rstrip('=')}\n"
    root, problem = _notes(signer).root(7, unpadded, ROOT)
    assert root is None and problem


def test_receipt_rows_are_still_compared_when_the_fast_paths_run(store, operator, raw) -> None:
    append_synthetic(store, operator, 4, batch=2)
    raw.drop_triggers()
    raw.execute("UPDATE receipts SET host = 'elsewhere' WHERE log_idx = 3")
    with pytest.raises(TamperError, match=r"index 3: the receipts query rows disagree .*\(host\)"):
        verify_log(store, workers=0)
