"""DSSE v1 envelopes: pre-authentication encoding, signing, strict parsing, verification, canonical bytes.

Spec: https://github.com/secure-systems-lab/dsse (envelope.md, protocol.md). Compatible with
securesystemslib's `dsse.Envelope` in both directions.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from receipts.canonical import canonical_json, loads
from receipts.errors import VerificationError
from receipts.keys import SigningKey, VerifyingKey

PAYLOAD_TYPE_INTOTO = "application/vnd.in-toto+json"

EnvelopeInput = Mapping[str, Any] | bytes | str
TrustedKeys = Iterable[VerifyingKey] | Mapping[str, VerifyingKey]


@dataclass(frozen=True)
class Signature:
    keyid: str  # "" when the envelope's signature carries no keyid (DSSE makes it optional)
    sig: bytes


@dataclass(frozen=True)
class Envelope:
    """A parsed envelope: decoded payload and signatures."""

    payload_type: str
    payload: bytes
    signatures: tuple[Signature, ...]

    def pae(self) -> bytes:
        return pae(self.payload_type, self.payload)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, base64 in the standard alphabet with padding."""
        return {
            "payloadType": self.payload_type,
            "payload": _b64encode(self.payload),
            "signatures": [{"keyid": s.keyid, "sig": _b64encode(s.sig)} for s in self.signatures],
        }


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSEv1 pre-authentication encoding: "DSSEv1" SP len(type) SP type SP len(body) SP body.

    Lengths are byte lengths in ASCII decimal; the signature covers these bytes, so the payload
    type is authenticated along with the payload.
    """
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(type_bytes), type_bytes, len(payload), payload)


def _b64encode(data: bytes) -> str:
    return base64.standard_b64encode(data).decode("ascii")


def _b64decode(text: Any, what: str) -> bytes:
    # DSSE allows the standard or the URL-safe alphabet; padding is optional. Anything else is refused
    # rather than skipped, so two different strings never decode to the same bytes by ignoring junk.
    if not isinstance(text, str):
        raise VerificationError(f"envelope {what} must be a base64 string, got {type(text).__name__}")
    normalized = text.replace("-", "+").replace("_", "/")
    normalized += "=" * (-len(normalized) % 4)
    try:
        return base64.b64decode(normalized.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise VerificationError(f"envelope {what} is not valid base64") from exc


def sign(payload_type: str, payload: bytes, key: SigningKey | Iterable[SigningKey]) -> dict[str, Any]:
    """A DSSE envelope of `payload`, signed over its PAE by `key` (or by each of several keys)."""
    if not isinstance(payload, bytes | bytearray):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    keys = [key] if isinstance(key, SigningKey) else list(key)
    if not keys:
        raise ValueError("sign() needs at least one signing key")
    keyids = [k.keyid for k in keys]
    if len(set(keyids)) != len(keyids):
        raise ValueError("the same key was given twice; each key signs an envelope once")
    message = pae(payload_type, bytes(payload))
    envelope = Envelope(
        payload_type=payload_type,
        payload=bytes(payload),
        signatures=tuple(Signature(keyid=k.keyid, sig=k.sign(message)) for k in keys),
    )
    return envelope.to_dict()


def parse(envelope: EnvelopeInput) -> Envelope:
    """Check an envelope's structure and decode it (signatures are NOT checked here)."""
    if isinstance(envelope, bytes | bytearray | str):
        try:
            envelope = loads(envelope)
        except (ValueError, UnicodeDecodeError) as exc:
            raise VerificationError(f"envelope is not valid JSON: {exc}") from exc
    if not isinstance(envelope, Mapping):
        raise VerificationError("envelope must be a JSON object with payloadType, payload and signatures")
    missing = [field for field in ("payloadType", "payload", "signatures") if field not in envelope]
    if missing:
        raise VerificationError(f"envelope is missing {', '.join(missing)}")
    payload_type = envelope["payloadType"]
    if not isinstance(payload_type, str) or not payload_type:
        raise VerificationError("envelope payloadType must be a non-empty string")
    payload = _b64decode(envelope["payload"], "payload")
    raw_signatures = envelope["signatures"]
    if not isinstance(raw_signatures, list) or not raw_signatures:
        raise VerificationError("envelope signatures must be a non-empty list")
    signatures = []
    for number, raw in enumerate(raw_signatures):
        if not isinstance(raw, Mapping) or "sig" not in raw:
            raise VerificationError(f"envelope signature {number} must be an object with a sig field")
        keyid = raw.get("keyid", "")
        if not isinstance(keyid, str):
            raise VerificationError(f"envelope signature {number} keyid must be a string")
        signatures.append(Signature(keyid=keyid, sig=_b64decode(raw["sig"], f"signature {number}")))
    return Envelope(payload_type=payload_type, payload=payload, signatures=tuple(signatures))


def _trusted_map(trusted_keys: TrustedKeys) -> dict[str, VerifyingKey]:
    if isinstance(trusted_keys, Mapping):
        return dict(trusted_keys)
    return {key.keyid: key for key in trusted_keys}


def verified_keyids(envelope: EnvelopeInput | Envelope, trusted_keys: TrustedKeys) -> list[str]:
    """Key ids of the trusted keys whose signatures verify, in envelope order.

    Signatures by keys not in `trusted_keys` are ignored. A signature that names a trusted keyid
    but does not verify is a forgery or a tampered envelope: VerificationError, even if another
    signature is good. With no keyid, each trusted key is tried. Raises VerificationError unless
    at least one trusted signature verifies.
    """
    parsed = envelope if isinstance(envelope, Envelope) else parse(envelope)
    trusted = _trusted_map(trusted_keys)
    if not trusted:
        raise VerificationError("no trusted keys to verify the envelope with; trust a key first")
    message = parsed.pae()
    good: list[str] = []
    for signature in parsed.signatures:
        if signature.keyid:
            key = trusted.get(signature.keyid)
            if key is None:
                continue
            key.verify(signature.sig, message)  # raises VerificationError naming the key
            if signature.keyid not in good:
                good.append(signature.keyid)
            continue
        for keyid, key in trusted.items():
            try:
                key.verify(signature.sig, message)
            except VerificationError:
                continue
            if keyid not in good:
                good.append(keyid)
            break
    if not good:
        named = sorted({s.keyid for s in parsed.signatures if s.keyid})
        detail = f" (signed by {', '.join(k[:16] for k in named)})" if named else ""
        raise VerificationError(f"envelope has no signature by a trusted key{detail}")
    return good


def with_keyids(envelope: Envelope, trusted_keys: TrustedKeys) -> Envelope:
    """The envelope with each signature that carries no keyid given the keyid of the trusted key whose
    signature it is (signatures of no trusted key keep theirs), so that verifiers which look keys up by
    keyid (securesystemslib) can verify it. The payload and signature bytes are unchanged."""
    if all(s.keyid for s in envelope.signatures):
        return envelope
    trusted = _trusted_map(trusted_keys)
    message = envelope.pae()
    named: list[Signature] = []
    for signature in envelope.signatures:
        keyid = signature.keyid
        if not keyid:
            for candidate, key in trusted.items():
                try:
                    key.verify(signature.sig, message)
                except VerificationError:
                    continue
                keyid = candidate
                break
        named.append(Signature(keyid=keyid, sig=signature.sig))
    return Envelope(envelope.payload_type, envelope.payload, tuple(named))


def verify(envelope: EnvelopeInput | Envelope, trusted_keys: TrustedKeys) -> bytes:
    """Return the payload if at least one trusted key signed it (see `verified_keyids`)."""
    parsed = envelope if isinstance(envelope, Envelope) else parse(envelope)
    verified_keyids(parsed, trusted_keys)
    return parsed.payload


# A string whose RFC 8785 form is itself in quotes: printable ASCII without a quote or a backslash.
_PLAIN = re.compile(r"[\x20-\x21\x23-\x5b\x5d-\x7e]*")


def _canonical_envelope(envelope: Envelope) -> bytes:
    """`canonical_json(envelope.to_dict())`, written directly when every string in it is plain (its
    JCS form is the string in quotes): the members in JCS order (payload, payloadType, signatures;
    keyid, sig). Base64 is always plain; a payload type or key id that is not goes through rfc8785."""
    payload_type = envelope.payload_type
    if _PLAIN.fullmatch(payload_type) and all(_PLAIN.fullmatch(s.keyid) for s in envelope.signatures):
        signatures = ",".join(
            f'{{"keyid":"{s.keyid}","sig":"{_b64encode(s.sig)}"}}' for s in envelope.signatures
        )
        return (
            f'{{"payload":"{_b64encode(envelope.payload)}","payloadType":"{payload_type}",'
            f'"signatures":[{signatures}]}}'
        ).encode("ascii")
    return canonical_json(envelope.to_dict())


def normal_form(envelope: EnvelopeInput | Envelope) -> tuple[bytes, Envelope]:
    """(envelope_bytes(envelope), the parsed envelope): parse(those bytes) gives the same envelope, so a
    caller that needs both parses once."""
    parsed = envelope if isinstance(envelope, Envelope) else parse(envelope)
    return _canonical_envelope(parsed), parsed


def envelope_bytes(envelope: EnvelopeInput | Envelope) -> bytes:
    """RFC 8785 bytes of the envelope in normal form (standard base64, keyid on every signature).

    These are the exact bytes the log stores and hashes. Fields outside DSSE are dropped; they
    are not covered by any signature.
    """
    return normal_form(envelope)[0]
