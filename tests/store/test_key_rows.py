"""The key query rows are derived data: an owner's rewrite of a key's public PEM, note or revocation reason
is named by `log verify`, and what the tool shows of a key comes from the log's key entries."""

from __future__ import annotations

import pytest

from receipts import keys
from receipts.errors import TamperError
from receipts.store import Store
from receipts.verify import verify_log

REWRITES = {
    "public_pem": "UPDATE signer_keys SET public_pem = :other",
    "note": "UPDATE signer_keys SET note = 'approved by security'",
    "reason": "UPDATE key_revocations SET reason = 'routine rotation'",
}


@pytest.mark.parametrize("column", sorted(REWRITES))
def test_log_verify_names_a_rewritten_key_column(store: Store, operator, raw, column: str) -> None:
    store.revoke_key(operator.keyid, "compromised")
    other = keys.generate().public_key().public_pem().decode()
    raw.drop_triggers()
    raw.execute(REWRITES[column], other=other)
    with pytest.raises(TamperError) as caught:
        verify_log(store)
    message = str(caught.value)
    assert message.startswith(
        "log verification failed at index 0: the signer_keys/key_revocations rows of key"
    )
    assert f"({column})" in message and operator.keyid[:16] in message


def test_keys_shown_come_from_the_key_entries_not_the_rewritten_rows(
    cli, db_url, store: Store, operator, raw
) -> None:
    other = keys.generate().public_key().public_pem().decode()
    raw.drop_triggers()
    raw.execute("UPDATE signer_keys SET public_pem = :other, note = 'forged'", other=other)
    exported = cli("keys", "export-public", operator.keyid[:12], "--db", db_url)
    assert exported.code == 0, exported.err
    assert exported.out == operator.public_key().public_pem().decode()
    assert keys.VerifyingKey.from_pem(exported.out.encode()).keyid == operator.keyid
    listed = store.signer_keys()
    assert [(k.keyid, k.note) for k in listed] == [(operator.keyid, "test operator")]
