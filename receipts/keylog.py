"""Key trust and revocation as log entries, and the key history they build: which signer keys are
valid at which log index.

A key entry's bytes are a small RFC 8785 JSON record, not a DSSE envelope: the log key already signs
every entry through the checkpoint it signs after each append, so a second signature would add nothing.

Validity rule: a key signs for the entries after its trust entry and before its revocation entry. A
receipt appended before the revocation stays valid; one appended after it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from receipts import dsse
from receipts.canonical import canonical_json
from receipts.errors import KeyFileError, VerificationError
from receipts.keys import VerifyingKey

KEY_TRUST_TYPE = "https://qualify.dev/log/key-trust/v1"
KEY_REVOKE_TYPE = "https://qualify.dev/log/key-revoke/v1"


@dataclass(frozen=True)
class TrustRecord:
    key: VerifyingKey
    note: str
    at: str


@dataclass(frozen=True)
class RevokeRecord:
    keyid: str
    reason: str
    at: str


def trust_record(key: VerifyingKey, note: str, at: datetime) -> bytes:
    """Canonical bytes of a key-trust entry (the time makes each entry's bytes unique)."""
    return canonical_json(
        {
            "_type": KEY_TRUST_TYPE,
            "keyid": key.keyid,
            "algorithm": key.algorithm,
            "publicKey": key.public_pem().decode("ascii"),
            "note": note,
            "at": at.isoformat(),
        }
    )


def revoke_record(keyid: str, reason: str, at: datetime) -> bytes:
    """Canonical bytes of a key-revoke entry."""
    return canonical_json({"_type": KEY_REVOKE_TYPE, "keyid": keyid, "reason": reason, "at": at.isoformat()})


def parse_key_record(data: bytes) -> TrustRecord | RevokeRecord:
    """Parse a key entry's bytes; VerificationError when they are not a well-formed record in
    canonical form, or when a trusted key's id does not match its public key."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise VerificationError(f"key entry is not JSON: {error}") from error
    if not isinstance(record, dict) or canonical_json(record) != bytes(data):
        raise VerificationError("key entry is not a canonical JSON object")
    kind = record.get("_type")
    try:
        if kind == KEY_TRUST_TYPE:
            key = VerifyingKey.from_pem(record["publicKey"].encode("ascii"), source="key-trust entry")
            if key.keyid != record["keyid"] or key.algorithm != record["algorithm"]:
                raise VerificationError(
                    f"key-trust entry names keyid {record['keyid']} but holds key {key.keyid}"
                )
            return TrustRecord(key=key, note=str(record["note"]), at=str(record["at"]))
        if kind == KEY_REVOKE_TYPE:
            return RevokeRecord(
                keyid=str(record["keyid"]), reason=str(record["reason"]), at=str(record["at"])
            )
    except (KeyError, AttributeError, KeyFileError) as error:
        raise VerificationError(f"malformed {kind} entry: {error}") from error
    raise VerificationError(f"unknown key entry type {kind!r}")


@dataclass
class KeyState:
    key: VerifyingKey
    trusted_at: int
    revoked_at: int | None = None
    note: str = ""
    reason: str = ""

    def valid_at(self, idx: int) -> bool:
        return self.trusted_at < idx and (self.revoked_at is None or idx < self.revoked_at)


class KeyHistory:
    """Trust and revocation events in log order; answers which keys may sign the entry at an index."""

    def __init__(self) -> None:
        self.keys: dict[str, KeyState] = {}

    def trust_refusal(self, keyid: str) -> str | None:
        """Why a key-trust entry for `keyid` may not be appended next, or None. The one rule, used when
        replaying the log and by the store before it appends."""
        state = self.keys.get(keyid)
        if state is None:
            return None
        if state.revoked_at is not None:
            return f"key {keyid[:16]} was revoked at log index {state.revoked_at}; generate a new key instead"
        return f"key {keyid[:16]} is already trusted (log index {state.trusted_at})"

    def revoke_refusal(self, keyid: str) -> str | None:
        """Why a key-revoke entry for `keyid` may not be appended next, or None (see trust_refusal)."""
        state = self.keys.get(keyid)
        if state is None:
            return f"key {keyid[:16]} is not trusted in this log; nothing to revoke"
        if state.revoked_at is not None:
            return f"key {keyid[:16]} is already revoked (log index {state.revoked_at})"
        return None

    def trust(self, idx: int, key: VerifyingKey, note: str = "") -> None:
        if (why := self.trust_refusal(key.keyid)) is not None:
            raise VerificationError(why)
        self.keys[key.keyid] = KeyState(key=key, trusted_at=idx, note=note)

    def revoke(self, idx: int, keyid: str, reason: str = "") -> None:
        if (why := self.revoke_refusal(keyid)) is not None:
            raise VerificationError(why)
        state = self.keys[keyid]
        state.revoked_at, state.reason = idx, reason

    def apply(self, idx: int, data: bytes) -> TrustRecord | RevokeRecord:
        """Replay one key entry's bytes (as verification does)."""
        record = parse_key_record(data)
        if isinstance(record, TrustRecord):
            self.trust(idx, record.key, record.note)
        else:
            self.revoke(idx, record.keyid, record.reason)
        return record

    def valid_at(self, idx: int) -> dict[str, VerifyingKey]:
        """Keys that may sign the entry at `idx`."""
        return {keyid: s.key for keyid, s in self.keys.items() if s.valid_at(idx)}

    def refusal(self, keyids: list[str], idx: int) -> str:
        """Why an envelope signed by `keyids` may not stand at `idx` (for the one-line error)."""
        for keyid in keyids:
            state = self.keys.get(keyid)
            if state is not None and state.revoked_at is not None and idx > state.revoked_at:
                return (
                    f"it is signed by key {keyid[:16]} which was revoked at log index {state.revoked_at}; "
                    "sign with a trusted key"
                )
        shown = ", ".join(k[:16] for k in keyids) or "no key id"
        return (
            f"it is signed by {shown}, not by a trusted key; trust the signer with: qualify keys trust FILE"
        )

    def signers(self, envelope: dsse.Envelope, idx: int, what: str) -> list[str]:
        """Key ids of the keys valid at `idx` whose signatures on `envelope` verify; VerificationError
        ("<what> refused: ...") saying why when there are none or a trusted key's signature is forged."""
        named = [s.keyid for s in envelope.signatures if s.keyid]
        anonymous = any(not s.keyid for s in envelope.signatures)
        if anonymous:
            valid = self.valid_at(idx)
        else:
            # Only the keys the signatures name can make them verify: O(signatures), not O(keys), which
            # matters when a fleet's log trusts a key per host.
            states = ((k, self.keys.get(k)) for k in dict.fromkeys(named))
            valid = {k: s.key for k, s in states if s is not None and s.valid_at(idx)}
        if not valid or (not anonymous and not any(k in valid for k in named)):
            raise VerificationError(f"{what} refused: {self.refusal(named, idx)}")
        try:
            return dsse.verified_keyids(envelope, valid)
        except VerificationError as error:
            raise VerificationError(f"{what} refused: {error}") from error
