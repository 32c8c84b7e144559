"""C2SP signed notes, checkpoints and tlog-proofs: published known answers, round trips, and refusals."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from receipts import merkle
from receipts.checkpoint import (
    Checkpoint,
    NoteSigner,
    NoteVerifier,
    format_tlog_proof,
    open_checkpoint,
    open_note,
    parse_tlog_proof,
    sign_checkpoint,
    verify_tlog_proof,
)
from receipts.errors import ProofError, VerificationError

VEC = Path(__file__).parent / "vectors"
NOTE = json.loads((VEC / "signed_note.json").read_text())
SPEC_PROOF = json.loads((VEC / "tlog_proof_spec_example.json").read_text())
TEXT = NOTE["text"]
PETER, ENOCH = NOTE["peter"], NOTE["enoch"]
ORIGIN = "qualify.example/log"


@pytest.fixture(scope="module")
def log_signer() -> NoteSigner:
    return NoteSigner(ORIGIN, Ed25519PrivateKey.generate())


@pytest.fixture(scope="module")
def witness() -> NoteSigner:
    return NoteSigner("witness.example/w1", Ed25519PrivateKey.generate())


def _sig_lines(note: str) -> str:
    return note[note.rindex("\n\n") + 2 :]


def _cp(size: int = 7, root: bytes = bytes(range(32)), ext: tuple[str, ...] = ()) -> Checkpoint:
    return Checkpoint(ORIGIN, size, root, ext)


# --- published known answers (golang.org/x/mod/sumdb/note) ---


def test_signing_the_published_text_with_the_published_key_reproduces_the_note_byte_for_byte():
    signer = NoteSigner.from_skey(PETER["skey"])
    assert signer.key_hash.hex() == PETER["key_hash"]
    assert signer.vkey() == PETER["vkey"]
    assert signer.sign(TEXT.encode()) == NOTE["peter_note"]


def test_the_published_note_opens_with_the_published_verifier_key():
    verifier = NoteVerifier.from_vkey(PETER["vkey"])
    assert verifier.name == PETER["name"] and verifier.key_hash.hex() == PETER["key_hash"]
    assert verifier.vkey() == PETER["vkey"]
    assert open_note(NOTE["peter_note"], [verifier]) == TEXT
    assert open_note(NOTE["peter_note"].encode(), [verifier]) == TEXT


def test_a_foreign_signature_beside_a_known_one_is_tolerated():
    note = TEXT + "\n" + PETER["sig_line"] + ENOCH["sig_line"]
    peter, enoch = NoteVerifier.from_vkey(PETER["vkey"]), NoteVerifier.from_vkey(ENOCH["vkey"])
    assert open_note(note, [peter]) == TEXT
    assert open_note(note, [enoch]) == TEXT
    assert open_note(note, [peter, enoch]) == TEXT


def test_a_note_signed_only_by_unknown_keys_is_refused():
    note = TEXT + "\n" + PETER["sig_line"] + ENOCH["sig_line"]
    with pytest.raises(VerificationError, match="no signature from a trusted key"):
        open_note(note, [])
    stranger = NoteSigner(PETER["name"], Ed25519PrivateKey.generate()).verifier()  # same name, other key
    with pytest.raises(VerificationError, match="no signature from a trusted key"):
        open_note(note, [stranger])


def test_a_tampered_text_is_refused():
    peter = NoteVerifier.from_vkey(PETER["vkey"])
    with pytest.raises(VerificationError, match="invalid signature for key PeterNeumann\\+c74f20a3"):
        open_note(NOTE["peter_note"].replace("cryptography", "cryptographY"), [peter])


def test_a_tampered_signature_is_refused_even_beside_a_good_one():
    peter, enoch = NoteVerifier.from_vkey(PETER["vkey"]), NoteVerifier.from_vkey(ENOCH["vkey"])
    sig = PETER["sig_line"]
    with pytest.raises(VerificationError, match="invalid signature"):
        open_note(TEXT + "\n" + sig[:60] + "ABCD" + sig[60:], [peter])
    flipped = base64.b64decode(sig.split(" ")[2])
    flipped = flipped[:10] + bytes([flipped[10] ^ 1]) + flipped[11:]
    bad_line = f"— PeterNeumann {base64.b64encode(flipped).decode()}\n"
    with pytest.raises(VerificationError, match="invalid signature"):
        open_note(TEXT + "\n" + ENOCH["sig_line"] + bad_line, [peter, enoch])


def test_repeated_signature_lines_from_a_known_key_are_accepted_once():
    peter = NoteVerifier.from_vkey(PETER["vkey"])
    note = TEXT + "\n" + PETER["sig_line"] * 2 + ENOCH["sig_line"] * 2
    assert open_note(note, [peter]) == TEXT


def test_two_trusted_keys_with_the_same_name_and_hash_are_refused_as_ambiguous():
    enoch = NoteVerifier.from_vkey(ENOCH["vkey"])
    peter = NoteVerifier.from_vkey(PETER["vkey"])
    with pytest.raises(VerificationError, match="ambiguous"):
        open_note(TEXT + "\n" + ENOCH["sig_line"], [enoch, peter, enoch])
    assert open_note(NOTE["peter_note"], [enoch, peter, enoch]) == TEXT  # the ambiguity is unused


def test_more_than_a_hundred_signatures_are_refused():
    peter = NoteVerifier.from_vkey(PETER["vkey"])
    with pytest.raises(VerificationError, match="malformed"):
        open_note(TEXT + "\n" + PETER["sig_line"] * 101, [peter])


@pytest.mark.parametrize(
    "note",
    [
        TEXT,
        TEXT + "\n",
        TEXT + "\n" + PETER["sig_line"][:-1],
        "\x01" + TEXT + "\n" + PETER["sig_line"],
        TEXT + "\n" + PETER["sig_line"].replace("PeterNeumann", "Bad Name"),
        TEXT + "\n" + PETER["sig_line"] + "Unexpected line.\n",
        TEXT + "\n" + PETER["sig_line"].replace("—", "-"),
        TEXT + "\n" + "— PeterNeumann AAAA\n",
        TEXT + "\n" + PETER["sig_line"].replace("PeterNeumann", "PeterNeumann+x"),
        TEXT + "\n" + PETER["sig_line"].replace("AM=", "AM"),
    ],
    ids=[
        "no-signatures",
        "blank-line-only",
        "no-final-newline",
        "control-char",
        "name-with-space",
        "trailing-line",
        "hyphen-not-em-dash",
        "signature-too-short",
        "name-with-plus",
        "unpadded-base64",
    ],
)
def test_malformed_notes_are_refused(note):
    with pytest.raises(VerificationError, match="malformed"):
        open_note(note, [NoteVerifier.from_vkey(PETER["vkey"])])


def test_invalid_utf8_is_refused():
    with pytest.raises(VerificationError, match="UTF-8"):
        open_note(b"\xff" + NOTE["peter_note"].encode(), [NoteVerifier.from_vkey(PETER["vkey"])])


def test_mangled_verifier_keys_are_refused():
    bad = list(NOTE["bad_vkeys"])
    vkey = PETER["vkey"]
    bad += [vkey[:i] for i in range(len(vkey))]  # every truncation
    bad += [vkey[:i] + chr(ord(vkey[i]) + 1) + vkey[i + 1 :] for i in range(len(vkey))]  # every char bumped
    for key in bad:
        with pytest.raises(VerificationError):
            NoteVerifier.from_vkey(key)


def test_mangled_signer_keys_are_refused():
    skey = PETER["skey"]
    for i in range(len(skey)):
        with pytest.raises(VerificationError):
            NoteSigner.from_skey(skey[:i] + chr(ord(skey[i]) + 1) + skey[i + 1 :])


@pytest.mark.parametrize("name", ["", "a b", "a+b", "a\tb", "a\u2003b"])
def test_key_names_with_spaces_or_plus_are_refused(name):
    with pytest.raises(VerificationError):
        NoteSigner(name, Ed25519PrivateKey.generate())


@pytest.mark.parametrize("body", [b"no newline", b"bad\x00control\n", b"\xffnot utf8\n"])
def test_signing_a_malformed_text_is_refused(log_signer, body):
    with pytest.raises(VerificationError):
        log_signer.sign(body)


def test_a_text_with_blank_lines_round_trips(log_signer):
    body = b"first\n\nsecond after a blank line\n\n"
    assert open_note(log_signer.sign(body), [log_signer.verifier()]) == body.decode()


# --- checkpoints ---


def test_checkpoint_body_is_the_c2sp_layout():
    root = bytes(range(32))
    cp = Checkpoint(ORIGIN, 20852163, root, ("ext one",))
    assert cp.body() == f"{ORIGIN}\n20852163\n{base64.b64encode(root).decode()}\next one\n".encode()
    assert Checkpoint.parse(cp.body()) == cp


@settings(max_examples=100, deadline=None)
@given(
    origin=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FFF), min_size=1, max_size=40),
    size=st.integers(0, 2**64),
    root=st.binary(min_size=32, max_size=32),
    ext=st.lists(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1), max_size=3),
)
def test_any_checkpoint_survives_body_and_parse(origin, size, root, ext):
    cp = Checkpoint(origin, size, root, tuple(ext))
    assert Checkpoint.parse(cp.body()) == cp
    assert Checkpoint.parse(cp.body().decode()) == cp


def test_a_signed_checkpoint_opens_with_the_logs_key(log_signer):
    cp = _cp(ext=("extension",))
    note = sign_checkpoint(cp, log_signer)
    assert note.startswith(cp.body().decode() + "\n— " + ORIGIN + " ")
    assert open_checkpoint(note, [log_signer.verifier()]) == cp
    assert open_checkpoint(note, [NoteVerifier.from_vkey(log_signer.vkey())], origin=ORIGIN) == cp


def test_a_witness_cosignature_beside_the_log_signature_is_tolerated(log_signer, witness):
    cp = _cp()
    note = sign_checkpoint(cp, log_signer) + _sig_lines(witness.sign(cp.body()))
    assert open_checkpoint(note, [log_signer.verifier()]) == cp
    assert open_checkpoint(note, [witness.verifier()]) == cp
    assert open_checkpoint(note, [log_signer.verifier(), witness.verifier()]) == cp


def test_a_checkpoint_signed_by_another_key_is_refused(log_signer):
    impostor = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    with pytest.raises(VerificationError, match="no signature from a trusted key"):
        open_checkpoint(sign_checkpoint(_cp(), impostor), [log_signer.verifier()])


def test_a_checkpoint_with_an_edited_size_or_root_is_refused(log_signer):
    cp = _cp(size=7)
    note = sign_checkpoint(cp, log_signer)
    for edited in (
        note.replace("\n7\n", "\n8\n", 1),
        note.replace(base64.b64encode(cp.root).decode(), base64.b64encode(bytes(32)).decode()),
    ):
        with pytest.raises(VerificationError, match="invalid signature"):
            open_checkpoint(edited, [log_signer.verifier()])


def test_a_checkpoint_from_another_log_is_refused_when_the_origin_is_given(log_signer):
    note = sign_checkpoint(_cp(), log_signer)
    with pytest.raises(VerificationError, match="belongs to log .*, not 'other.example/log'"):
        open_checkpoint(note, [log_signer.verifier()], origin="other.example/log")


ROOT_B64 = base64.b64encode(bytes(range(32))).decode()


@pytest.mark.parametrize(
    "body",
    [
        f"{ORIGIN}\n7\n{ROOT_B64}",  # no final newline
        f"{ORIGIN}\n7\n",  # no root line
        f"\n7\n{ROOT_B64}\n",  # empty origin
        f"{ORIGIN}\n07\n{ROOT_B64}\n",  # leading zero
        f"{ORIGIN}\n-1\n{ROOT_B64}\n",
        f"{ORIGIN}\n+1\n{ROOT_B64}\n",
        f"{ORIGIN}\n 7\n{ROOT_B64}\n",
        f"{ORIGIN}\nseven\n{ROOT_B64}\n",
        f"{ORIGIN}\n7\n{ROOT_B64[:-1]}\n",  # unpadded
        f"{ORIGIN}\n7\n{base64.b64encode(bytes(31)).decode()}\n",  # 31-byte root
        f"{ORIGIN}\n7\n{base64.b64encode(bytes(33)).decode()}\n",
        f"{ORIGIN}\n7\n{ROOT_B64[:-2]}9=\n",  # same bytes, non-canonical trailing bits
        f"{ORIGIN}\n7\n{ROOT_B64}\n\n",  # empty extension line
        f"{ORIGIN}\n7\nnot base64!\n",
    ],
)
def test_malformed_checkpoint_bodies_are_refused(log_signer, body):
    with pytest.raises(VerificationError, match="checkpoint body is malformed"):
        Checkpoint.parse(body.encode())
    if body.endswith("\n"):  # still refused once properly signed: the signature does not make it a checkpoint
        with pytest.raises(VerificationError, match="checkpoint body is malformed"):
            open_checkpoint(log_signer.sign(body.encode()), [log_signer.verifier()])


def test_constructing_an_invalid_checkpoint_is_refused():
    for args in [("", 1, bytes(32)), (ORIGIN, -1, bytes(32)), (ORIGIN, 1, bytes(31)), ("a\nb", 1, bytes(32))]:
        with pytest.raises(ValueError):
            Checkpoint(*args)
    with pytest.raises(ValueError):
        Checkpoint(ORIGIN, 1, bytes(32), ("",))


# --- tlog-proof ---


def test_the_spec_example_proof_parses():
    p = parse_tlog_proof(SPEC_PROOF["text"])
    assert p.index == SPEC_PROOF["index"]
    assert len(p.proof) == SPEC_PROOF["proof_count"] and all(len(h) == 32 for h in p.proof)
    assert p.extra is not None and p.extra.startswith(b"age-v1.2.1-darwin-arm64.tar.gz")
    assert p.checkpoint_text.startswith(f"{SPEC_PROOF['origin']}\n{SPEC_PROOF['checkpoint_size']}\n")
    assert format_tlog_proof(p.index, p.proof, p.checkpoint_text, p.extra) == SPEC_PROOF["text"]


def test_tlog_proof_layout_and_round_trip(log_signer):
    signed = sign_checkpoint(_cp(), log_signer)
    hashes = [bytes([i]) * 32 for i in range(3)]
    text = format_tlog_proof(5, hashes, signed)
    lines = [base64.b64encode(h).decode() for h in hashes]
    assert text == "c2sp.org/tlog-proof@v1\nindex 5\n" + "\n".join(lines) + "\n\n" + signed
    p = parse_tlog_proof(text)
    assert (p.index, p.proof, p.checkpoint_text, p.extra) == (5, hashes, signed, None)
    with_extra = parse_tlog_proof(format_tlog_proof(0, [], signed, extra=b"vrf"))
    assert (with_extra.index, with_extra.proof, with_extra.extra) == (0, [], b"vrf")
    assert parse_tlog_proof(format_tlog_proof(0, [], signed, extra=b"")).extra == b""


def _logged_tree(n: int) -> tuple[list[bytes], merkle.MemoryTree]:
    hashes = [merkle.leaf_hash(f"receipt {i}".encode()) for i in range(n)]
    tree = merkle.MemoryTree()
    for h in hashes:
        tree.append(h)
    return hashes, tree


def test_a_tlog_proof_proves_a_leaf_under_a_signed_checkpoint(log_signer):
    hashes, tree = _logged_tree(13)
    signed = sign_checkpoint(Checkpoint(ORIGIN, 13, tree.root()), log_signer)
    for index in (0, 5, 12):
        text = format_tlog_proof(index, tree.inclusion_proof(index), signed)
        parsed, cp = verify_tlog_proof(text, hashes[index], [log_signer.verifier()], origin=ORIGIN)
        assert (parsed.index, cp.size) == (index, 13)
    text = format_tlog_proof(5, tree.inclusion_proof(5), signed)
    with pytest.raises(ProofError):
        verify_tlog_proof(text, hashes[6], [log_signer.verifier()])
    with pytest.raises(ProofError):
        verify_tlog_proof(text.replace("index 5", "index 4"), hashes[5], [log_signer.verifier()])
    other = NoteSigner(ORIGIN, Ed25519PrivateKey.generate())
    with pytest.raises(VerificationError):
        verify_tlog_proof(text, hashes[5], [other.verifier()])


H32 = base64.b64encode(bytes(32)).decode()


@pytest.mark.parametrize(
    "text",
    [
        "wrong-header\nindex 0\n\ncheckpoint\n",
        "c2sp.org/tlog-proof@v1\nextra !!notbase64!!\nindex 0\n\ncheckpoint\n",
        "c2sp.org/tlog-proof@v1\n\n\ncheckpoint\n",
        "c2sp.org/tlog-proof@v1\nindex notanumber\n\ncheckpoint\n",
        "c2sp.org/tlog-proof@v1\nindex -5\n\ncheckpoint\n",
        "c2sp.org/tlog-proof@v1\nindex 007\n\ncheckpoint\n",
        "c2sp.org/tlog-proof@v1\nindex 0\n!!notbase64!!\n\ncheckpoint\n",
        f"c2sp.org/tlog-proof@v1\nindex 0\n{base64.b64encode(bytes(64)).decode()}\n\ncheckpoint\n",
        f"c2sp.org/tlog-proof@v1\nindex 0\n{H32}\n",
        f"c2sp.org/tlog-proof@v1\nindex 0\n{H32}\n\n",
        f"c2sp.org/tlog-proof@v1\nindex 0\nextra {H32}\n\ncheckpoint\n",
    ],
    ids=[
        "header",
        "extra-base64",
        "missing-index",
        "index-nan",
        "index-negative",
        "index-leading-zero",
        "hash-base64",
        "hash-64-bytes",
        "no-checkpoint",
        "empty-checkpoint",
        "extra-after-index",
    ],
)
def test_malformed_tlog_proofs_are_refused(text):
    with pytest.raises(VerificationError, match="tlog-proof is malformed"):
        parse_tlog_proof(text)


def test_formatting_a_bad_tlog_proof_is_refused(log_signer):
    signed = sign_checkpoint(_cp(), log_signer)
    with pytest.raises(ValueError):
        format_tlog_proof(-1, [], signed)
    with pytest.raises(ValueError):
        format_tlog_proof(0, [bytes(31)], signed)
    with pytest.raises(ValueError):
        format_tlog_proof(0, [], signed.rstrip("\n"))
