"""C2SP signed notes (Ed25519), tlog-checkpoint bodies, and tlog-proof bundles: the log's signed tree
heads and the offline inclusion proofs built on them (c2sp.org/signed-note, /tlog-checkpoint, /tlog-proof).

tlog-proof@v1 text, as published::

    c2sp.org/tlog-proof@v1
    extra <base64 opaque data>        (optional line)
    index <decimal, no leading zeros>
    <base64 hash>                     (zero or more: the inclusion proof, leaf's sibling first)
                                      (one empty line)
    <signed checkpoint note, verbatim>
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from receipts import merkle, sodium
from receipts.errors import VerificationError

__all__ = [
    "Checkpoint",
    "NoteSigner",
    "NoteVerifier",
    "TlogProof",
    "format_tlog_proof",
    "open_checkpoint",
    "open_note",
    "parse_tlog_proof",
    "sign_checkpoint",
    "verify_tlog_proof",
]

SIG_ED25519 = 0x01
# The spec requires accepting at least 16; 100 matches golang.org/x/mod/sumdb/note and bounds the work.
MAX_SIGNATURES = 100
TLOG_PROOF_HEADER = "c2sp.org/tlog-proof@v1"
_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def _b64decode(s: str) -> bytes:
    """Strict standard base64: padding required and the encoding canonical, so one value has one text."""
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{s[:24]!r} is not standard base64") from None
    if base64.b64encode(raw).decode("ascii") != s:
        raise ValueError(f"{s[:24]!r} is not canonical base64")
    return raw


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _text_problem(text: str) -> str | None:
    for ch in text:
        if ch < " " and ch != "\n":
            return f"contains control character U+{ord(ch):04X}"
    return None


def _name_problem(name: str) -> str | None:
    if not name:
        return "is empty"
    if "+" in name or any(ch.isspace() for ch in name):
        return "contains a space or '+'"
    if _text_problem(name):
        return "contains a control character"
    return None


def key_hash(name: str, public_key: bytes) -> bytes:
    """C2SP key ID for an Ed25519 key: SHA-256(name || '\\n' || 0x01 || 32-byte public key)[:4]."""
    return hashlib.sha256(name.encode() + b"\n" + bytes([SIG_ED25519]) + public_key).digest()[:4]


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


# --- keys ---


class NoteVerifier:
    """A trusted Ed25519 note key: name, 4-byte key hash and public key."""

    def __init__(self, name: str, public_key: Ed25519PublicKey) -> None:
        if problem := _name_problem(name):
            raise VerificationError(f"note key name {name!r} {problem}; use a name like example.com/log")
        self.name = name
        self.public_key = public_key
        self._raw = _raw_public(public_key)
        self.key_hash = key_hash(name, self._raw)

    @classmethod
    def from_vkey(cls, vkey: str) -> NoteVerifier:
        """Parse `<name>+<8 hex key hash>+<base64(0x01 || public key)>` (golang.org/x/mod/sumdb/note)."""
        bad = f"verifier key {vkey[:40]!r} is malformed"
        parts = vkey.split("+", 2)  # the base64 part may itself contain '+'
        if len(parts) != 3:
            raise VerificationError(f"{bad}: expected <name>+<hex key hash>+<base64 key>")
        name, hash_hex, key_b64 = parts
        if not re.fullmatch(r"[0-9a-fA-F]{8}", hash_hex):
            raise VerificationError(f"{bad}: the key hash must be 8 hex digits")
        try:
            blob = _b64decode(key_b64)
        except ValueError:
            raise VerificationError(f"{bad}: the key is not standard base64") from None
        if len(blob) != 33 or blob[0] != SIG_ED25519:
            raise VerificationError(f"{bad}: only Ed25519 keys (type 0x01, 32 bytes) are supported")
        verifier = cls(name, Ed25519PublicKey.from_public_bytes(blob[1:]))
        if verifier.key_hash != bytes.fromhex(hash_hex):
            raise VerificationError(f"{bad}: the key hash does not match the name and key")
        return verifier

    def vkey(self) -> str:
        return (
            f"{self.name}+{self.key_hash.hex()}+{_b64(bytes([SIG_ED25519]) + _raw_public(self.public_key))}"
        )

    def verify(self, message: bytes, signature: bytes) -> bool:
        if sodium.ed25519_valid(self._raw, signature, message):
            return True  # libsodium's "valid" (see receipts.sodium); a refusal is OpenSSL's to decide
        try:
            self.public_key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


class NoteSigner:
    """An Ed25519 note signing key under a key name (for a log: its origin)."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey) -> None:
        if problem := _name_problem(name):
            raise VerificationError(f"note key name {name!r} {problem}; use a name like example.com/log")
        self.name = name
        self.private_key = private_key
        self._verifier = NoteVerifier(name, private_key.public_key())
        self.key_hash = self._verifier.key_hash

    @classmethod
    def from_skey(cls, skey: str) -> NoteSigner:
        """Parse `PRIVATE+KEY+<name>+<hex key hash>+<base64(0x01 || seed)>` (golang.org/x/mod/sumdb/note)."""
        parts = skey.split("+", 4)
        if len(parts) != 5 or parts[:2] != ["PRIVATE", "KEY"]:
            raise VerificationError("signer key is malformed: expected PRIVATE+KEY+<name>+<hash>+<key>")
        _, _, name, hash_hex, key_b64 = parts
        try:
            blob = _b64decode(key_b64)
        except ValueError:
            raise VerificationError("signer key is malformed: the key is not standard base64") from None
        if len(blob) != 33 or blob[0] != SIG_ED25519 or not re.fullmatch(r"[0-9a-fA-F]{8}", hash_hex):
            raise VerificationError("signer key is malformed: only Ed25519 keys (type 0x01) are supported")
        signer = cls(name, Ed25519PrivateKey.from_private_bytes(blob[1:]))
        if signer.key_hash != bytes.fromhex(hash_hex):
            raise VerificationError("signer key is malformed: the key hash does not match the name and key")
        return signer

    def vkey(self) -> str:
        return self._verifier.vkey()

    def verifier(self) -> NoteVerifier:
        return self._verifier

    def sign(self, body: bytes) -> str:
        """The complete signed note: body, blank line, one signature line."""
        text = _note_text(body)
        sig = self.private_key.sign(text.encode())
        return f"{text}\n— {self.name} {_b64(self.key_hash + sig)}\n"


def _note_text(body: bytes | str) -> str:
    try:
        text = body.decode("utf-8") if isinstance(body, (bytes, bytearray)) else body
    except UnicodeDecodeError:
        raise VerificationError("note text is not valid UTF-8; sign text only") from None
    if not text.endswith("\n"):
        raise VerificationError("note text must end with a newline")
    if problem := _text_problem(text):
        raise VerificationError(f"note text {problem}; only newline is allowed among control characters")
    return text


# --- opening notes ---


def open_note(note: str | bytes, verifiers: Iterable[NoteVerifier]) -> str:
    """Return the note's text once a signature from a trusted key verifies.

    Signatures from unknown keys are ignored (witnesses, rotated keys); a bad signature from a trusted
    key rejects the whole note, as does a note with no verified trusted signature."""
    if isinstance(note, (bytes, bytearray)):
        try:
            note = note.decode("utf-8")
        except UnicodeDecodeError:
            raise VerificationError(
                "signed note is not valid UTF-8; pass the note exactly as written"
            ) from None
    malformed = "signed note is malformed"
    if problem := _text_problem(note):
        raise VerificationError(f"{malformed}: it {problem}")
    split = note.rfind("\n\n")
    if split < 0:
        raise VerificationError(f"{malformed}: no blank line before the signature lines")
    text, sigs = note[: split + 1], note[split + 2 :]
    if not sigs or not sigs.endswith("\n"):
        raise VerificationError(f"{malformed}: it must end with signature lines, each ending in a newline")

    trusted: dict[tuple[str, bytes], list[NoteVerifier]] = {}
    for v in verifiers:
        trusted.setdefault((v.name, v.key_hash), []).append(v)

    lines = sigs[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise VerificationError(f"{malformed}: more than {MAX_SIGNATURES} signature lines")
    verified: set[tuple[str, bytes]] = set()
    seen_names: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.startswith("— "):
            raise VerificationError(f"{malformed}: signature line {number} does not start with '— '")
        name, _, sig_b64 = line[2:].partition(" ")
        try:
            blob = _b64decode(sig_b64)
        except ValueError:
            blob = b""
        if _name_problem(name) or len(blob) < 5:
            raise VerificationError(f"{malformed}: signature line {number} is not '— <name> <base64>'")
        ident = (name, blob[:4])
        seen_names.append(f"{name}+{blob[:4].hex()}")
        candidates = trusted.get(ident)
        if not candidates:
            continue  # a key we do not know, e.g. a witness cosignature
        if len(candidates) > 1:
            raise VerificationError(
                f"ambiguous verifier key {name}+{blob[:4].hex()}: two trusted keys share it; trust only one"
            )
        if ident in verified:
            continue  # a repeat of a signature already checked from the same key
        if not candidates[0].verify(text.encode(), blob[4:]):
            raise VerificationError(
                f"invalid signature for key {name}+{blob[:4].hex()}: the note was altered or signed by "
                "another key"
            )
        verified.add(ident)
    if not verified:
        raise VerificationError(
            f"note has no signature from a trusted key (signed by {', '.join(seen_names)}); "
            "trust the log's verifier key or check you have the right note"
        )
    return text


# --- checkpoints ---


@dataclass(frozen=True)
class Checkpoint:
    """A tlog-checkpoint: origin, tree size, root hash, and optional extension lines."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if problem := self._problem():
            raise ValueError(f"checkpoint {problem}")

    def _problem(self) -> str | None:
        if not self.origin or "\n" in self.origin or _text_problem(self.origin):
            return "origin must be one non-empty line without control characters"
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            return f"size must be a non-negative integer, got {self.size!r}"
        if not isinstance(self.root, bytes) or len(self.root) != merkle.HASH_SIZE:
            return f"root must be a {merkle.HASH_SIZE}-byte SHA-256 hash"
        for ext in self.extensions:
            if not ext or "\n" in ext or _text_problem(ext):
                return "extension lines must be non-empty single lines without control characters"
        return None

    def body(self) -> bytes:
        lines = [self.origin, str(self.size), _b64(self.root), *self.extensions]
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def parse(cls, body: bytes | str) -> Checkpoint:
        """Parse a checkpoint note text, refusing anything that would not re-encode to the same bytes."""
        bad = "checkpoint body is malformed"
        try:
            text = body.decode("utf-8") if isinstance(body, (bytes, bytearray)) else body
        except UnicodeDecodeError:
            raise VerificationError(f"{bad}: not valid UTF-8") from None
        if not text.endswith("\n"):
            raise VerificationError(f"{bad}: it must end with a newline")
        lines = text[:-1].split("\n")
        if len(lines) < 3:
            raise VerificationError(f"{bad}: expected origin, tree size and root hash lines")
        origin, size_text, root_text, *extensions = lines
        if not _DECIMAL.fullmatch(size_text):
            raise VerificationError(
                f"{bad}: tree size {size_text[:24]!r} is not a decimal without leading zeros"
            )
        try:
            root = _b64decode(root_text)
        except ValueError as exc:
            raise VerificationError(f"{bad}: root hash {exc}") from None
        try:
            return cls(origin, int(size_text), root, tuple(extensions))
        except ValueError as exc:
            raise VerificationError(f"{bad}: {exc}") from None


def _claimed_origin(note_text: str | bytes) -> str | None:
    """The origin line a note claims, unverified (only to name the log in an error)."""
    if isinstance(note_text, (bytes, bytearray)):
        note_text = note_text.decode("utf-8", "replace")
    first = note_text.split("\n", 1)[0]
    return first if first and not _text_problem(first) else None


def sign_checkpoint(cp: Checkpoint, signer: NoteSigner) -> str:
    """The checkpoint as a signed note."""
    return signer.sign(cp.body())


def open_checkpoint(
    note_text: str | bytes, verifiers: Sequence[NoteVerifier], origin: str | None = None
) -> Checkpoint:
    """Verify a signed checkpoint against trusted keys and parse it; with `origin`, also require it.
    A checkpoint of another log (whose key, named for its own origin, this log does not trust) is named
    as such rather than reported as a bad signature."""
    try:
        text = open_note(note_text, verifiers)
    except VerificationError:
        claimed = _claimed_origin(note_text)
        if origin is not None and claimed is not None and claimed != origin:
            raise VerificationError(
                f"this checkpoint belongs to log {claimed!r}, not {origin!r}; use a checkpoint of this log"
            ) from None
        raise
    cp = Checkpoint.parse(text)
    if origin is not None and cp.origin != origin:
        raise VerificationError(
            f"this checkpoint belongs to log {cp.origin!r}, not {origin!r}; use a checkpoint of this log"
        )
    return cp


# --- tlog-proof ---


@dataclass(frozen=True)
class TlogProof:
    """A parsed c2sp.org/tlog-proof@v1: leaf index, inclusion proof, signed checkpoint, extra data."""

    index: int
    proof: list[bytes]
    checkpoint_text: str
    extra: bytes | None = None


def format_tlog_proof(
    index: int, proof: Sequence[bytes], signed_checkpoint: str, extra: bytes | None = None
) -> str:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"tlog-proof index must be a non-negative integer, got {index!r}")
    if any(len(h) != merkle.HASH_SIZE for h in proof):
        raise ValueError(f"tlog-proof hashes must be {merkle.HASH_SIZE}-byte SHA-256 hashes")
    if not signed_checkpoint.endswith("\n"):
        raise ValueError("the signed checkpoint must end with a newline, as a signed note does")
    lines = [TLOG_PROOF_HEADER]
    if extra is not None:
        lines.append(f"extra {_b64(extra)}")
    lines.append(f"index {index}")
    lines.extend(_b64(h) for h in proof)
    return "\n".join(lines) + "\n\n" + signed_checkpoint


def parse_tlog_proof(text: str | bytes) -> TlogProof:
    bad = "tlog-proof is malformed"
    if isinstance(text, (bytes, bytearray)):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise VerificationError(f"{bad}: not valid UTF-8") from None
    head, sep, checkpoint_text = text.partition("\n\n")
    if not sep or not checkpoint_text:
        raise VerificationError(f"{bad}: no blank line followed by the signed checkpoint")
    lines = head.split("\n")
    if lines[0] != TLOG_PROOF_HEADER:
        raise VerificationError(f"{bad}: the first line must be {TLOG_PROOF_HEADER!r}")
    pos = 1
    extra = None
    if pos < len(lines) and lines[pos].startswith("extra "):
        try:
            extra = _b64decode(lines[pos][len("extra ") :])
        except ValueError:
            raise VerificationError(f"{bad}: the extra data is not standard base64") from None
        pos += 1
    if pos >= len(lines) or not lines[pos].startswith("index "):
        raise VerificationError(f"{bad}: missing the 'index <n>' line")
    index_text = lines[pos][len("index ") :]
    if not _DECIMAL.fullmatch(index_text):
        raise VerificationError(f"{bad}: index {index_text[:24]!r} is not a decimal without leading zeros")
    proof = []
    for number, line in enumerate(lines[pos + 1 :], 1):
        try:
            h = _b64decode(line)
        except ValueError:
            raise VerificationError(f"{bad}: proof hash {number} is not standard base64") from None
        if len(h) != merkle.HASH_SIZE:
            raise VerificationError(f"{bad}: proof hash {number} is {len(h)} bytes, not {merkle.HASH_SIZE}")
        proof.append(h)
    return TlogProof(int(index_text), proof, checkpoint_text, extra)


def verify_tlog_proof(
    text: str | bytes, leaf_hash: bytes, verifiers: Sequence[NoteVerifier], origin: str | None = None
) -> tuple[TlogProof, Checkpoint]:
    """Check the checkpoint's signature, then the leaf's inclusion under it; raises VerificationError
    (bad format or signature) or merkle.ProofError (the leaf is not proven)."""
    parsed = parse_tlog_proof(text)
    cp = open_checkpoint(parsed.checkpoint_text, verifiers, origin)
    merkle.verify_inclusion(parsed.index, cp.size, leaf_hash, parsed.proof, cp.root)
    return parsed, cp
