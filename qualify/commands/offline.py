"""Offline verification, no store needed (as `rekor-cli verify` / `cosign verify-blob` do it): a receipt's
inclusion proof (`qualify receipts prove`) against the log's verifier key, with its DSSE signature against
the operator's public key; and a consistency proof between two signed checkpoints (`qualify log
consistency`). Exit 0 verified, 1 does not verify, 2 bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from qualify.commands._common import json_option, parse_vkey
from qualify.errors import UsageError
from qualify.limits import MAX_IMPORT_BYTES, MAX_POLICY_BYTES, read_bytes_limited, read_text_limited
from receipts import dsse, merkle
from receipts.checkpoint import open_checkpoint, verify_tlog_proof
from receipts.errors import ReceiptsError, VerificationError
from receipts.keys import VerifyingKey

MAX_PROOF_BYTES = MAX_POLICY_BYTES  # a tlog-proof or consistency proof: a few KiB in practice


def _verifier(vkey: str):  # noqa: ANN202
    try:
        return parse_vkey(vkey)
    except ReceiptsError as exc:
        raise UsageError(f"--vkey: {exc}") from exc


def _done(ok: bool, data: dict[str, Any], line: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"verified": ok, **data}, indent=2))
    else:
        click.echo(line, err=not ok)
    sys.exit(0 if ok else 1)


@click.command("verify-proof")
@click.argument("proof", type=click.Path(dir_okay=False))
@click.option("--envelope", "envelope_path", type=click.Path(dir_okay=False),
              help="The receipt's exact DSSE envelope (`qualify receipts show ID --envelope`).")  # fmt: skip
@click.option("--bundle", "bundle_path", type=click.Path(dir_okay=False),
              help="Or the receipt's Sigstore bundle (`qualify receipts bundle`): its envelope.")  # fmt: skip
@click.option(
    "--vkey", required=True, help="The log's verifier key (`qualify log vkey`), or a file holding it."
)
@click.option("--key", "key_path", type=click.Path(dir_okay=False),
              help="The operator's public key (`keys export-public`): also check the signature.")  # fmt: skip
@json_option
def verify_proof(
    proof: str,
    envelope_path: str | None,
    bundle_path: str | None,
    vkey: str,
    key_path: str | None,
    as_json: bool,
) -> None:
    """Verify a receipt offline: PROOF (a C2SP tlog-proof from `qualify receipts prove`, or the one
    `receipts bundle` writes beside the bundle) proves that the envelope's exact bytes (--envelope, or
    the --bundle's dsseEnvelope) are a leaf of the log under a checkpoint signed by --vkey; with --key,
    the envelope's DSSE signature too. No store is opened."""
    if (envelope_path is None) == (bundle_path is None):
        raise UsageError("give --envelope FILE or --bundle FILE")
    verifier = _verifier(vkey)
    text = read_text_limited(proof, MAX_PROOF_BYTES, "proof")
    if bundle_path is not None:
        from receipts.canonical import loads
        from receipts.sigstore_bundle import envelope_from_bundle

        try:
            raw = envelope_from_bundle(loads(read_bytes_limited(bundle_path, MAX_IMPORT_BYTES, "bundle")))
        except (ValueError, ReceiptsError) as exc:
            raise UsageError(f"{bundle_path} is not a qualify Sigstore bundle: {exc}") from None
    else:
        raw = read_bytes_limited(str(envelope_path), MAX_IMPORT_BYTES, "envelope")
    key = None
    if key_path:
        try:
            key = VerifyingKey.from_pem(Path(key_path).read_bytes(), source=key_path)
        except OSError as exc:
            raise UsageError(f"cannot read public key {key_path}: {exc.strerror or exc}") from exc
        except (ValueError, ReceiptsError) as exc:
            raise UsageError(f"{key_path} is not a public key qualify can use: {exc}") from exc
    leaf = merkle.leaf_hash(raw)
    data: dict[str, Any] = {"leaf_hash": leaf.hex(), "vkey": verifier.vkey()}
    try:
        parsed, cp = verify_tlog_proof(text, leaf, [verifier])
    except (VerificationError, merkle.ProofError) as exc:
        _done(False, {**data, "error": str(exc)}, f"FAILED: {exc}", as_json)
        return
    data.update(log_index=parsed.index, origin=cp.origin, tree_size=cp.size, root_hash=cp.root.hex())
    signer = None
    if key is not None:
        try:
            ids = dsse.verified_keyids(raw, {key.keyid: key})
        except (VerificationError, ValueError) as exc:
            ids, data["signature_error"] = [], str(exc)
        if not ids:
            why = data.get("signature_error") or f"no signature by key {key.keyid[:16]}"
            _done(
                False, {**data, "signature": False}, f"FAILED: the envelope is in the log, but {why}", as_json
            )
            return
        signer = key.keyid
        data.update(signature=True, keyid=signer)
    signed = f"; signed by key {signer[:16]}" if signer else " (signature not checked: give --key)"
    line = (
        f"OK: the envelope is entry {parsed.index} of log {cp.origin} at size {cp.size} "
        f"(root {cp.root.hex()[:16]}…){signed}"
    )
    _done(True, data, line, as_json)


FORMAT = "qualify-consistency-proof/v1"


def consistency_document(old: str, new: str, proof: list[bytes]) -> dict[str, Any]:
    """What `qualify log consistency --out` writes: both signed checkpoints and the RFC 9162 proof."""
    return {"format": FORMAT, "old": old, "new": new, "hashes": [h.hex() for h in proof]}


@click.command("verify-consistency")
@click.argument("proof", type=click.Path(dir_okay=False))
@click.option(
    "--vkey", required=True, help="The log's verifier key (`qualify log vkey`), or a file holding it."
)
@json_option
def verify_consistency(proof: str, vkey: str, as_json: bool) -> None:
    """Verify offline that the log only grew between two signed checkpoints: PROOF is what `qualify log
    consistency --out` writes (both checkpoints and the proof hashes). No store is opened."""
    verifier = _verifier(vkey)
    text = read_text_limited(proof, MAX_PROOF_BYTES, "consistency proof")
    try:
        doc = json.loads(text)
        old_note, new_note = doc["old"], doc["new"]
        hashes = [bytes.fromhex(h) for h in doc["hashes"]]
        if doc.get("format") != FORMAT or not all(isinstance(x, str) for x in (old_note, new_note)):
            raise ValueError(f"not a {FORMAT} document")
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(
            f"{proof} is not a consistency proof from `qualify log consistency --out`: {exc}"
        ) from None
    try:
        old = open_checkpoint(old_note, [verifier])
        new = open_checkpoint(new_note, [verifier], origin=old.origin)
        merkle.verify_consistency(old.size, new.size, hashes, old.root, new.root)
    except (VerificationError, merkle.ProofError) as exc:
        _done(False, {"error": str(exc)}, f"FAILED: {exc}", as_json)
        return
    data = {"origin": old.origin, "old_size": old.size, "new_size": new.size, "root_hash": new.root.hex()}
    line = f"OK: log {old.origin} at size {new.size} extends its checkpoint at size {old.size}"
    _done(True, data, line, as_json)
