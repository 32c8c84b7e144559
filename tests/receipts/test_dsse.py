"""DSSE envelopes: PAE known answers, sign/verify, tampering refused, securesystemslib interop both ways."""

from __future__ import annotations

import base64
import copy
import json

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.exceptions import VerificationError as SslibVerificationError
from securesystemslib.signer import CryptoSigner, SSlibKey

from receipts import dsse, keys
from receipts.canonical import canonical_json
from receipts.errors import VerificationError

ALGORITHMS = ["ed25519", "p256"]
PAYLOAD = b'{"_type":"https://in-toto.io/Statement/v1","subject":[]}'


@pytest.fixture(scope="module", params=ALGORITHMS)
def key(request) -> keys.SigningKey:
    return keys.generate(request.param)


def test_pae_matches_the_dsse_spec_example() -> None:
    assert (
        dsse.pae("http://example.com/HelloWorld", b"hello world")
        == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


def test_pae_counts_bytes_not_characters() -> None:
    assert dsse.pae("é", b"\x00\xff") == b"DSSEv1 2 \xc3\xa9 2 \x00\xff"
    assert dsse.pae("", b"") == b"DSSEv1 0  0 "


def test_signed_envelope_has_dsse_fields_and_returns_the_payload(key) -> None:
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key)
    assert set(env) == {"payloadType", "payload", "signatures"}
    assert env["payloadType"] == "application/vnd.in-toto+json"
    assert base64.standard_b64decode(env["payload"]) == PAYLOAD
    assert env["signatures"][0]["keyid"] == key.keyid
    assert dsse.verify(env, [key.public_key()]) == PAYLOAD
    assert dsse.verify(json.dumps(env), {key.keyid: key.public_key()}) == PAYLOAD
    assert dsse.verify(json.dumps(env).encode(), [key.public_key()]) == PAYLOAD


def _tampered(env: dict, field: str) -> dict:
    env = copy.deepcopy(env)
    if field == "payload":
        env["payload"] = base64.standard_b64encode(PAYLOAD.replace(b"[]", b"[1]")).decode()
    elif field == "payloadType":
        env["payloadType"] = "application/json"
    else:
        sig = bytearray(base64.standard_b64decode(env["signatures"][0]["sig"]))
        sig[-1] ^= 0x01
        env["signatures"][0]["sig"] = base64.standard_b64encode(bytes(sig)).decode()
    return env


@pytest.mark.parametrize("field", ["payload", "payloadType", "sig"])
def test_tampered_envelope_is_refused(key, field: str) -> None:
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key)
    with pytest.raises(VerificationError):
        dsse.verify(_tampered(env, field), [key.public_key()])


def test_envelope_signed_by_an_untrusted_key_is_refused(key) -> None:
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key)
    other = keys.generate(key.algorithm)
    with pytest.raises(VerificationError, match="no signature by a trusted key"):
        dsse.verify(env, [other.public_key()])
    with pytest.raises(VerificationError, match="no trusted keys"):
        dsse.verify(env, [])


def test_signature_claiming_a_trusted_keyid_is_checked_with_that_key(key) -> None:
    # An attacker copies a trusted keyid onto a signature of their own: refused, not skipped.
    attacker = keys.generate(key.algorithm)
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, attacker)
    env["signatures"][0]["keyid"] = key.keyid
    with pytest.raises(VerificationError, match="does not verify"):
        dsse.verify(env, [key.public_key()])


def test_untrusted_signatures_are_ignored_when_a_trusted_one_verifies() -> None:
    trusted, stranger = keys.generate("ed25519"), keys.generate("p256")
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, [stranger, trusted])
    assert dsse.verified_keyids(env, [trusted.public_key()]) == [trusted.keyid]
    both = [trusted.public_key(), stranger.public_key()]
    assert dsse.verified_keyids(env, both) == [stranger.keyid, trusted.keyid]


def test_a_forged_trusted_signature_spoils_the_envelope_even_beside_a_good_one() -> None:
    good, forged = keys.generate(), keys.generate()
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, [good, forged])
    env["signatures"][1]["sig"] = env["signatures"][0]["sig"]
    with pytest.raises(VerificationError):
        dsse.verify(env, [good.public_key(), forged.public_key()])


def test_signature_without_keyid_is_tried_against_every_trusted_key(key) -> None:
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key)
    del env["signatures"][0]["keyid"]
    assert dsse.verified_keyids(env, [keys.generate().public_key(), key.public_key()]) == [key.keyid]
    with pytest.raises(VerificationError):
        dsse.verify(env, [keys.generate().public_key()])


def test_same_key_twice_is_refused_when_signing(key) -> None:
    with pytest.raises(ValueError, match="twice"):
        dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, [key, key])
    with pytest.raises(ValueError, match="at least one"):
        dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, [])


@pytest.mark.parametrize(
    "envelope, message",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ("[]", "JSON object"),
        ({"payloadType": "t", "payload": "aGk="}, "missing signatures"),
        ({"payloadType": "", "payload": "aGk=", "signatures": [{"sig": "aGk="}]}, "payloadType"),
        ({"payloadType": "t", "payload": "a*Gk", "signatures": [{"sig": "aGk="}]}, "payload is not valid"),
        ({"payloadType": "t", "payload": 5, "signatures": [{"sig": "aGk="}]}, "base64 string"),
        ({"payloadType": "t", "payload": "aGk=", "signatures": []}, "non-empty list"),
        ({"payloadType": "t", "payload": "aGk=", "signatures": ["x"]}, "signature 0"),
        ({"payloadType": "t", "payload": "aGk=", "signatures": [{"keyid": 1, "sig": "aGk="}]}, "keyid"),
        ({"payloadType": "t", "payload": "aGk=", "signatures": [{"sig": "!!"}]}, "signature 0 is not"),
    ],
)
def test_malformed_envelope_is_refused_with_one_line(envelope, message: str) -> None:
    with pytest.raises(VerificationError, match=message) as err:
        dsse.verify(envelope, [keys.generate().public_key()])
    assert "\n" not in str(err.value)


def test_url_safe_unpadded_base64_is_accepted_as_dsse_allows(key) -> None:
    payload = b"\xfb\xff\xfe?"  # encodes with '+' and '/' in the standard alphabet
    env = dsse.sign("t", payload, key)
    env["payload"] = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    assert dsse.verify(env, [key.public_key()]) == payload


def test_envelope_bytes_are_canonical_and_verify(key) -> None:
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key)
    stored = dsse.envelope_bytes(env)
    assert stored == canonical_json(env)
    assert stored == dsse.envelope_bytes(json.dumps(env, indent=2))
    assert stored.startswith(b'{"payload":')  # RFC 8785 sorts keys
    assert dsse.verify(stored, [key.public_key()]) == PAYLOAD


def test_envelope_bytes_normalise_base64_and_drop_unsigned_fields(key) -> None:
    env = dsse.sign("t", b"\xfb\xff\xfe?", key)
    variant = copy.deepcopy(env)
    variant["payload"] = variant["payload"].replace("+", "-").replace("/", "_").rstrip("=")
    variant["note"] = "not covered by the signature"
    assert dsse.envelope_bytes(variant) == dsse.envelope_bytes(env)


# ----------------------------------------------------------------- securesystemslib interop, both ways


def test_our_envelope_verifies_with_securesystemslib(key) -> None:
    env = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key)
    theirs = SslibEnvelope.from_dict(copy.deepcopy(env))
    accepted = theirs.verify([key.public_key().to_sslib()], threshold=1)
    assert list(accepted) == [key.keyid]
    assert theirs.payload == PAYLOAD


def test_securesystemslib_refuses_our_tampered_envelope(key) -> None:
    env = _tampered(dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, PAYLOAD, key), "payload")
    theirs = SslibEnvelope.from_dict(env)
    with pytest.raises(SslibVerificationError):
        theirs.verify([key.public_key().to_sslib()], threshold=1)


def test_securesystemslib_envelope_verifies_with_ours(key) -> None:
    signer = CryptoSigner(key.crypto)
    theirs = SslibEnvelope(PAYLOAD, dsse.PAYLOAD_TYPE_INTOTO, {})
    theirs.sign(signer)
    env = json.loads(json.dumps(theirs.to_dict()))
    assert env["signatures"][0]["keyid"] == key.keyid
    assert dsse.verify(env, [key.public_key()]) == PAYLOAD
    assert dsse.verified_keyids(env, [key.public_key()]) == [key.keyid]


def _from_sslib(public: SSlibKey) -> keys.VerifyingKey:
    # securesystemslib stores Ed25519 keys as raw hex and ECDSA keys as PEM.
    value = public.keyval["public"]
    if public.keytype == "ed25519":
        return keys.VerifyingKey(ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(value)))
    return keys.VerifyingKey.from_pem(value.encode())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_securesystemslib_generated_key_envelope_verifies_with_ours(algorithm: str) -> None:
    signer = CryptoSigner.generate_ed25519() if algorithm == "ed25519" else CryptoSigner.generate_ecdsa()
    theirs = SslibEnvelope(b"payload", "text/plain", {})
    theirs.sign(signer)
    public = _from_sslib(signer.public_key)
    assert public.algorithm == algorithm
    assert public.keyid == signer.public_key.keyid
    assert dsse.verify(theirs.to_dict(), [public]) == b"payload"
    tampered = theirs.to_dict()
    tampered["payloadType"] = "text/html"
    with pytest.raises(VerificationError):
        dsse.verify(tampered, [public])


_ODD = ["", "a", '"', "\\", "\n", "\x00", "\x1f", "\x7f", "é", "\u2028", "😀", "a b", "x/y+z=", "\ud800"]


@pytest.mark.parametrize("keyid", _ODD)
@pytest.mark.parametrize("payload_type", ["application/vnd.in-toto+json", *[t for t in _ODD if t]])
def test_envelope_bytes_written_directly_are_the_rfc8785_bytes(payload_type: str, keyid: str) -> None:
    # The direct form (plain strings) and the rfc8785 fallback (any other) must be the same bytes.
    for payload in (b"", b"{}", bytes(range(256))):
        envelope = dsse.Envelope(
            payload_type, payload, (dsse.Signature(keyid, b"\x01" * 64), dsse.Signature("k2", b""))
        )
        try:
            expected = canonical_json(envelope.to_dict())
        except Exception as error:  # noqa: BLE001 - a lone surrogate: both must refuse it
            with pytest.raises(type(error)):
                dsse.envelope_bytes(envelope)
            continue
        data, parsed = dsse.normal_form(envelope)
        assert data == expected == dsse.envelope_bytes(envelope)
        assert parsed == envelope == dsse.parse(data)
