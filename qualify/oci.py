"""Receipts stored with the image they qualify, in its OCI registry, through the `oras` client.

`attach` writes one receipt two ways, both referring to the image's manifest digest:

- **OCI 1.1 referrers form**: an OCI image manifest with `artifactType`
  application/vnd.dev.sigstore.bundle.v0.3+json, `subject` = the image manifest's descriptor, and two
  layers: the Sigstore bundle (`qualify receipts bundle`) and the C2SP tlog-proof of the receipt's
  inclusion in the log. A registry with the referrers API lists it under
  `/v2/<repo>/referrers/<digest>` by itself (it answers the push with an `OCI-Subject` header); for one
  without (Docker's distribution 2.x, which the tests run), the referrers tag schema of the OCI
  distribution spec is kept up to date: the tag `sha256-<hex>` holds an image index of the referrers.
- **cosign's tag form**: the tag `sha256-<hex>.att`, an image manifest whose layers are DSSE envelopes
  (media type application/vnd.dsse.envelope.v1+json, annotation `predicateType`), which cosign and
  policy engines that predate OCI 1.1 read. The layer is the exact stored envelope; the tlog-proof rides
  along as the layer annotation `dev.qualify.tlog-proof`.

`read_back` collects the receipts attached to an image by either form, each as its exact envelope bytes
and, where it came with one, its tlog-proof; deciding what they are worth is the caller's job
(`qualify approve --from-registry` verifies each against the log's keys). Every request has a timeout
and every manifest and blob read a size limit.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from qualify.errors import UsageError
from receipts.errors import ReceiptsError
from receipts.sigstore_bundle import BUNDLE_MEDIA_TYPE, envelope_from_bundle

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DSSE_LAYER = "application/vnd.dsse.envelope.v1+json"
PROOF_LAYER = "application/vnd.dev.qualify.tlog-proof.v1+text"
PROOF_ANNOTATION = "dev.qualify.tlog-proof"
RECEIPT_ANNOTATION = "dev.qualify.receipt.id"
PREDICATE_ANNOTATION = "dev.sigstore.bundle.predicateType"
COSIGN_SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX, DOCKER_LIST)

REQUEST_TIMEOUT_S = 30
MAX_MANIFEST_BYTES = 4 << 20  # the OCI distribution spec's suggested manifest limit
MAX_BLOB_BYTES = 16 << 20  # a bundle or proof is a few KiB; an envelope at most MAX_IMPORT_BYTES
MAX_REFERRERS = 500  # attestations read back per image


@dataclass(frozen=True)
class Image:
    """An image as its registry names it: where it is, its manifest's digest, media type and size, and
    its config digest (what `docker images` shows as the image id; None for an index)."""

    registry: str
    repository: str
    reference: str
    digest: str
    media_type: str
    size: int
    config_digest: str | None

    @property
    def tag_prefix(self) -> str:
        return self.digest.replace(":", "-")

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Attestation:
    """A receipt found with an image: its exact envelope bytes, its tlog-proof if it came with one, and
    where it was found."""

    envelope: bytes
    proof: str | None
    found_in: list[str] = field(default_factory=list)

    @property
    def receipt_id(self) -> str:
        return hashlib.sha256(self.envelope).hexdigest()


def _plain_http_default(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Registry:
    """An oras client for one image reference, with a timeout on every request."""

    def __init__(self, ref: str, plain_http: bool | None = None) -> None:
        try:
            import oras.container
            import oras.provider
        except ImportError as exc:  # pragma: no cover - oras is a dependency
            raise UsageError("OCI attachments need the oras package (pip install oras)") from exc
        try:
            self.container = oras.container.Container(ref)
        except ValueError as exc:
            raise UsageError(f"{ref!r} is not an image reference (registry/repository:tag): {exc}") from None
        if "/" not in ref or not self.container.registry:
            raise UsageError(f"--image {ref}: name the registry too, e.g. 127.0.0.1:5000/engine:tag")
        self.ref = ref
        insecure = _plain_http_default(self.container.registry) if plain_http is None else plain_http
        self.client = oras.provider.Registry(hostname=self.container.registry, insecure=insecure)
        self.client.session.request = functools.partial(  # type: ignore[method-assign]
            self.client.session.request, timeout=REQUEST_TIMEOUT_S
        )
        # oras retries a failed request five times, sleeping 3 + 3**n s between tries (over two minutes
        # for a registry that is down). One try, bounded by the timeout above, says so at once.
        unretried = getattr(oras.provider.Registry.do_request, "__wrapped__", None)
        if unretried is not None:
            self.client.do_request = types.MethodType(unretried, self.client)  # type: ignore[method-assign]
        self.base = f"{self.client.prefix}://{self.container.registry}/v2/{self.container.api_prefix}"

    # ------------------------------------------------------------------ low level

    def _request(self, url: str, method: str = "GET", **kwargs: Any) -> Any:
        import requests

        try:
            return self.client.do_request(url, method, **kwargs)
        except requests.RequestException as exc:
            raise UsageError(f"registry {self.container.registry} did not answer: {exc}") from None

    def _get(self, path: str, accept: str, limit: int) -> tuple[bytes, str, str] | None:
        """(bytes, content type, digest) of a manifest or blob, None when the registry has none."""
        import requests

        response = self._request(f"{self.base}/{path}", headers={"Accept": accept}, stream=True)
        try:
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise UsageError(
                    f"registry {self.container.registry} answered {response.status_code} for {path}: "
                    f"{response.raw.read(200).decode('utf-8', 'replace')}"
                )
            # At most `limit` bytes are read, whatever the registry sends or says it will send.
            chunks, size = [], 0
            for chunk in response.iter_content(chunk_size=1 << 16):
                size += len(chunk)
                if size > limit:
                    raise UsageError(f"{path} in {self.container.registry} is over {limit} bytes; not read")
                chunks.append(chunk)
        except requests.RequestException as exc:
            raise UsageError(f"registry {self.container.registry} did not answer: {exc}") from None
        finally:
            response.close()
        data = b"".join(chunks)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        kind = response.headers.get("Content-Type", "").split(";")[0].strip()
        return data, kind, digest

    def manifest(self, reference: str) -> tuple[bytes, str, str] | None:
        return self._get(f"manifests/{reference}", ", ".join(MANIFEST_TYPES), MAX_MANIFEST_BYTES)

    def blob(self, digest: str, limit: int | None = None) -> bytes:
        found = self._get(f"blobs/{digest}", "*/*", MAX_BLOB_BYTES if limit is None else limit)
        if found is None or found[2] != digest:
            raise UsageError(f"blob {digest} is missing from {self.ref}, or its bytes are not that digest")
        return found[0]

    def put_blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        layer = {"mediaType": media_type, "digest": digest, "size": len(data)}
        fd, path = tempfile.mkstemp(prefix="qualify-oci-")
        import requests

        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            response = self.client.upload_blob(path, self.container, layer)
        except requests.RequestException as exc:
            raise UsageError(f"registry {self.container.registry} did not answer: {exc}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if response.status_code not in (200, 201, 202):
            raise UsageError(f"registry refused blob {digest}: {response.status_code} {response.text[:200]}")
        return layer

    def put_manifest(self, reference: str, document: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """PUT a manifest (or index) as compact JSON; its descriptor and the response."""
        data = json.dumps(document, separators=(",", ":"), sort_keys=True).encode()
        media_type = document["mediaType"]
        response = self._request(
            f"{self.base}/manifests/{reference}", "PUT", data=data, headers={"Content-Type": media_type}
        )
        if response.status_code not in (200, 201):
            raise UsageError(
                f"registry {self.container.registry} refused manifest {reference}: {response.status_code} "
                f"{response.text[:300]}"
            )
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        return {"mediaType": media_type, "digest": digest, "size": len(data)}, response

    def referrers(self, image: Image) -> tuple[bytes, str, str] | None:
        """The referrers API's index for the image, None where the registry has no such API."""
        try:
            return self._get(f"referrers/{image.digest}", OCI_INDEX, MAX_MANIFEST_BYTES)
        except UsageError:
            return None  # e.g. 400/405 from a registry that predates the API: the tag schema is used

    def has_referrers_api(self, image: Image) -> bool:
        return self.referrers(image) is not None

    # ------------------------------------------------------------------ the image

    def image(self) -> Image:
        reference = self.container.digest or self.container.tag or "latest"
        found = self.manifest(reference)
        if found is None:
            raise UsageError(f"image {self.ref} is not in its registry (no manifest {reference})")
        data, kind, digest = found
        if self.container.digest and digest != self.container.digest:
            raise UsageError(
                f"{self.ref}: the registry's manifest bytes are not digest {self.container.digest}"
            )
        document = json.loads(data)
        kind = kind or document.get("mediaType", OCI_MANIFEST)
        config = (
            (document.get("config") or {}).get("digest") if kind in (OCI_MANIFEST, DOCKER_MANIFEST) else None
        )
        return Image(
            registry=self.container.registry,
            repository=self.container.api_prefix,
            reference=reference,
            digest=digest,
            media_type=kind,
            size=len(data),
            config_digest=config,
        )


# ---------------------------------------------------------------------- attach


def attach(
    ref: str,
    *,
    bundle: dict[str, Any],
    proof: str,
    predicate_type: str,
    plain_http: bool | None = None,
) -> dict[str, Any]:
    """Store the receipt's bundle (and tlog-proof) with the image: the referrers form and the .att tag
    form. Returns what was written (digests and tags)."""
    registry = Registry(ref, plain_http)
    image = registry.image()
    envelope = envelope_from_bundle(bundle)
    receipt_id = hashlib.sha256(envelope).hexdigest()
    created = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")

    # 1. OCI 1.1: an artifact manifest whose subject is the image (once per receipt: attaching again
    #    finds the one already listed and writes nothing new).
    listed = [
        m
        for m in _referrers(registry, image)
        if m.get("artifactType") == BUNDLE_MEDIA_TYPE
        and (m.get("annotations") or {}).get(RECEIPT_ANNOTATION) == receipt_id
    ]
    empty = registry.put_blob(b"{}", OCI_EMPTY)
    bundle_layer = registry.put_blob(json.dumps(bundle, indent=2).encode() + b"\n", BUNDLE_MEDIA_TYPE)
    proof_layer = registry.put_blob(proof.encode(), PROOF_LAYER)
    annotations = {
        PREDICATE_ANNOTATION: predicate_type,
        RECEIPT_ANNOTATION: receipt_id,
        "org.opencontainers.image.created": created,
    }
    artifact = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": BUNDLE_MEDIA_TYPE,
        "config": empty,
        "layers": [bundle_layer, proof_layer],
        "subject": image.descriptor(),
        "annotations": annotations,
    }
    if listed:
        descriptor = {k: listed[0][k] for k in ("mediaType", "digest", "size") if k in listed[0]}
        referrers_api = registry.has_referrers_api(image)
    else:
        descriptor, response = registry.put_manifest(_digest_ref(artifact), artifact)
        referrers_api = bool(response.headers.get("OCI-Subject"))
    fallback = None
    if not referrers_api:
        fallback = _add_to_referrers_index(registry, image, {**descriptor, "artifactType": BUNDLE_MEDIA_TYPE,
                                                             "annotations": annotations})  # fmt: skip

    # 2. cosign's tag form: sha256-<hex>.att, one DSSE layer per attestation.
    att_tag = f"{image.tag_prefix}.att"
    att = _add_to_att(registry, att_tag, envelope, proof, predicate_type)
    return {
        "image": ref,
        "image_digest": image.digest,
        "image_config_digest": image.config_digest,
        "receipt_id": receipt_id,
        "referrer": descriptor["digest"],
        "referrers_api": referrers_api,
        "referrers_tag": fallback,
        "att_tag": att_tag,
        "att_manifest": att,
    }


def _digest_ref(document: dict[str, Any]) -> str:
    data = json.dumps(document, separators=(",", ":"), sort_keys=True).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add_to_referrers_index(registry: Registry, image: Image, descriptor: dict[str, Any]) -> str:
    """The OCI referrers tag schema: tag sha256-<hex> holds an image index of the image's referrers."""
    tag = image.tag_prefix
    found = registry.manifest(tag)
    index = json.loads(found[0]) if found else {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
    if index.get("mediaType") != OCI_INDEX:
        raise UsageError(f"tag {tag} in {image.repository} is not an OCI image index; not overwritten")
    if all(m.get("digest") != descriptor["digest"] for m in index.get("manifests", [])):
        index.setdefault("manifests", []).append(descriptor)
        registry.put_manifest(tag, index)
    return tag


def _add_to_att(registry: Registry, tag: str, envelope: bytes, proof: str, predicate_type: str) -> str:
    found = registry.manifest(tag)
    layers: list[dict[str, Any]] = []
    if found is not None:
        existing = json.loads(found[0])
        layers = [layer for layer in existing.get("layers", []) if isinstance(layer, dict)]
    layer = registry.put_blob(envelope, DSSE_LAYER)
    if all(old.get("digest") != layer["digest"] for old in layers):
        layers.append(
            {
                **layer,
                "annotations": {
                    COSIGN_SIGNATURE_ANNOTATION: "",
                    "predicateType": predicate_type,
                    PROOF_ANNOTATION: proof,
                },
            }
        )
    config = {
        "architecture": "",
        "os": "",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [item["digest"] for item in layers]},
    }
    config_layer = registry.put_blob(
        json.dumps(config, separators=(",", ":"), sort_keys=True).encode(), OCI_CONFIG
    )
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_layer, "layers": layers}
    descriptor, _ = registry.put_manifest(tag, manifest)
    return str(descriptor["digest"])


# ---------------------------------------------------------------------- read back


def read_back(ref: str, plain_http: bool | None = None) -> tuple[Image, list[Attestation]]:
    """The image and every receipt attached to it (referrers API or its tag, then the .att tag),
    deduplicated by receipt id."""
    registry = Registry(ref, plain_http)
    image = registry.image()
    found: dict[str, Attestation] = {}

    def add(envelope: bytes, proof: str | None, where: str) -> None:
        item = Attestation(envelope, proof)
        have = found.get(item.receipt_id)
        if have is None:
            found[item.receipt_id] = Attestation(envelope, proof, [where])
        else:
            found[item.receipt_id] = Attestation(envelope, have.proof or proof, [*have.found_in, where])

    for descriptor in _referrers(registry, image):
        if descriptor.get("artifactType") != BUNDLE_MEDIA_TYPE:
            continue
        got = registry.manifest(str(descriptor.get("digest")))
        if got is None:
            continue
        manifest = json.loads(got[0])
        if (manifest.get("subject") or {}).get("digest") != image.digest:
            continue  # an index entry pointing at an artifact about another image: ignored
        bundle_bytes, proof = None, None
        for layer in manifest.get("layers", []):
            if layer.get("mediaType") == BUNDLE_MEDIA_TYPE and bundle_bytes is None:
                bundle_bytes = registry.blob(str(layer.get("digest")))
            elif layer.get("mediaType") == PROOF_LAYER and proof is None:
                proof = registry.blob(str(layer.get("digest"))).decode("utf-8", "replace")
        if bundle_bytes is not None:
            with contextlib.suppress(ValueError, ReceiptsError):  # not a bundle: not a receipt of ours
                add(envelope_from_bundle(json.loads(bundle_bytes)), proof, f"referrer {got[2]}")
    att = registry.manifest(f"{image.tag_prefix}.att")
    if att is not None:
        for layer in list(_layers(att[0]))[:MAX_REFERRERS]:
            if layer.get("mediaType") != DSSE_LAYER:
                continue
            proof = (layer.get("annotations") or {}).get(PROOF_ANNOTATION)
            add(registry.blob(str(layer.get("digest"))), proof if isinstance(proof, str) else None, "att tag")
    return image, list(found.values())


def _layers(data: bytes) -> Iterator[dict[str, Any]]:
    for layer in json.loads(data).get("layers", []):
        if isinstance(layer, dict):
            yield layer


def _referrers(registry: Registry, image: Image) -> list[dict[str, Any]]:
    """The referrers API where the registry has it, else the referrers tag schema's index."""
    index: dict[str, Any] | None = None
    found = registry.referrers(image)
    if found is not None:
        with contextlib.suppress(ValueError):
            index = json.loads(found[0])
    if index is None:
        found = registry.manifest(image.tag_prefix)
        index = json.loads(found[0]) if found else {"manifests": []}
    manifests = [m for m in index.get("manifests", []) if isinstance(m, dict)]
    return manifests[:MAX_REFERRERS]
