// Verify a Sigstore bundle with sigstore-js (@sigstore/verify) against one trusted public key.
//   node sigstore_verify.cjs BUNDLE.json PUBLIC.pem KEYID
// The key is found only under KEYID (the bundle's publicKey.hint must name it). No tlog entry and no
// timestamp are required: this log's inclusion proof travels beside the bundle (docs/FORMATS.md).
// Prints {"ok": true, ...} and exits 0, or {"ok": false, "error": ...} and exits 1.
'use strict';
const fs = require('fs');
const { bundleFromJSON } = require('@sigstore/bundle');
const { Verifier, toSignedEntity, toTrustMaterial } = require('@sigstore/verify');

const [bundlePath, keyPath, keyid] = process.argv.slice(2);
try {
  const bundle = bundleFromJSON(JSON.parse(fs.readFileSync(bundlePath, 'utf8')));
  const pem = fs.readFileSync(keyPath, 'utf8');
  const emptyRoot = { certificateAuthorities: [], timestampAuthorities: [], tlogs: [], ctlogs: [] };
  const trust = toTrustMaterial(emptyRoot, { [keyid]: { rawBytes: pem } });
  const verifier = new Verifier(trust, { tlogThreshold: 0, ctlogThreshold: 0, timestampThreshold: 0 });
  const entity = toSignedEntity(bundle);
  verifier.verify(entity);
  const payloadType = bundle.content.dsseEnvelope.payloadType;
  const statement = JSON.parse(Buffer.from(bundle.content.dsseEnvelope.payload).toString('utf8'));
  console.log(JSON.stringify({
    ok: true,
    mediaType: bundle.mediaType,
    hint: bundle.verificationMaterial.content.publicKey.hint,
    payloadType,
    predicateType: statement.predicateType,
  }));
} catch (err) {
  console.log(JSON.stringify({ ok: false, error: `${err.code || err.name}: ${err.message}` }));
  process.exit(1);
}
