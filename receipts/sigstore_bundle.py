"""A stored receipt as a Sigstore bundle (v0.3), for tools that verify Sigstore bundles (sigstore-js
`@sigstore/verify`, cosign `verify-blob-attestation --new-bundle-format`).

What goes in (protobuf-specs `dev.sigstore.bundle.v1.Bundle`, its JSON form)::

    mediaType             application/vnd.dev.sigstore.bundle.v0.3+json
    dsseEnvelope          the stored DSSE envelope, field for field (payload, payloadType, one signature
                          with its keyid): RFC 8785 of this object is the exact stored bytes, whose hash
                          is the receipt's leaf in the log
    verificationMaterial  publicKey.hint = the signer's key id (securesystemslib key id, as `qualify keys
                          list` prints it); tlogEntries = [] (see below)

Why the log's inclusion is *beside* the bundle, not in tlogEntries: a bundle's transparency-log entry is
a Rekor entry. Its leaf is the hash of a Rekor `canonicalizedBody` (a dsse/intoto kind record) and its
log is identified by a Rekor log id; verifiers recompute that body from the bundle and check it. This
log's leaf is the hash of the envelope bytes themselves, so an entry in tlogEntries would be refused by
every conforming verifier (or would have to lie about the body). The C2SP tlog-proof (checkpoint and
inclusion proof, what `qualify receipts prove` prints) is written next to the bundle instead, and
`qualify verify-proof PROOF ENVELOPE` (or any C2SP tlog-proof verifier) checks it against the bundle's
envelope. A verifier of the bundle alone must therefore be told not to require a tlog entry or a
timestamp (sigstore-js: `tlogThreshold: 0, timestampThreshold: 0`; cosign: `--insecure-ignore-tlog`).
"""

from __future__ import annotations

from typing import Any

from receipts import dsse
from receipts.canonical import canonical_json, loads
from receipts.errors import VerificationError

BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"


def bundle_of(envelope_bytes: bytes) -> dict[str, Any]:
    """The Sigstore bundle of one stored envelope (its exact bytes); VerificationError unless it holds
    exactly one signature with a key id and its bytes are in the normal form the log stores."""
    parsed = dsse.parse(envelope_bytes)
    if len(parsed.signatures) != 1:
        raise VerificationError(
            f"a Sigstore bundle holds one signature; this envelope has {len(parsed.signatures)}"
        )
    (signature,) = parsed.signatures
    if not signature.keyid:
        raise VerificationError("the envelope's signature names no key id; a bundle needs it as its hint")
    envelope = loads(envelope_bytes)
    if canonical_json(envelope) != envelope_bytes:
        raise VerificationError("the envelope bytes are not in the log's normal form (RFC 8785)")
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": signature.keyid}, "tlogEntries": []},
        "dsseEnvelope": envelope,
    }
    # Never hand out a bundle whose envelope is not, byte for byte, the logged one.
    assert envelope_from_bundle(bundle) == envelope_bytes
    return bundle


def envelope_from_bundle(bundle: Any) -> bytes:
    """The exact envelope bytes a bundle carries (RFC 8785 of its dsseEnvelope): hash them as the log's
    leaf to check the tlog-proof that travels beside the bundle. VerificationError for anything but a
    v0.3 DSSE bundle."""
    if not isinstance(bundle, dict) or bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise VerificationError(f"not a Sigstore bundle of media type {BUNDLE_MEDIA_TYPE}")
    envelope = bundle.get("dsseEnvelope")
    if not isinstance(envelope, dict):
        raise VerificationError("the bundle carries no dsseEnvelope")
    data = canonical_json(envelope)
    dsse.parse(data)  # structure only; signatures are checked against keys the caller trusts
    return data
