"""The launch document (docs/PROTOCOL.md, "Launch"): what the harness asks the engine to be, in one JSON file
passed as `serve --launch FILE`, built from the request, the harness's geometry choices and the model
dimensions the engine declared in its manifest. The checks derive every expectation from this document
(the peer's geometry, the capacities, the weights file), never from the reference engine's presets.

Pure Python (the harness never imports the engine): the group and view derivation restates the peer's own
(qualify/engine/peer.py, which must stand alone inside a container); tests keep the two equal.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from qualify.protocol import (
    KDA_STATE_DTYPE,
    MAX_MANIFEST_BYTES,
    SUPPORTED_PROTOCOL_VERSIONS,
    EngineManifest,
    KvRegion,
    LaunchCapacity,
    LaunchDocument,
    LaunchGeometry,
    LaunchGroup,
    LaunchView,
    LaunchWeights,
    ModelDims,
)
from qualify.run.geometry import GEOMETRY, KvGeometry
from receipts.statement import config_digest

if TYPE_CHECKING:
    from qualify.run.request import RunRequest

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_NUM_BATCHED_TOKENS = 4096  # the harness's capacity choice (every check's batch fits well inside it)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def span_of(kind: str, g: LaunchGeometry) -> int:
    return g.block_size if kind == "kda" else g.block_size * g.dcp_size


def kv_groups(g: LaunchGeometry, cap: LaunchCapacity, m: ModelDims) -> list[LaunchGroup]:
    """Every group allocation as the peer will expect it (docs/PEER.md): layers of one kind in layer order,
    group_size at a time, KDA groups first; per KDA layer an fp32 state [slots, H, V, K] (V = K) and a conv
    state [slots, 3HK, width-1]; per attention layer K and V [blocks, shards, block_size, kv_heads,
    head_dim]; views aligned, then the probe page. slots = 1 + max_num_seqs * (1 + num_spec); blocks =
    1 + max_num_seqs * ceil(max_model_len / attention span); shards = dcp_size folded, 1 per DCP rank."""
    slots = 1 + cap.max_num_seqs * (1 + cap.num_spec)
    blocks = 1 + cap.max_num_seqs * -(-cap.max_model_len // span_of("attention", g))
    shards = g.dcp_size if g.dcp_ranks == 1 else 1
    out: list[LaunchGroup] = []
    for kind, letter in (("kda", "K"), ("attention", "A")):
        layers = [i for i, c in enumerate(g.layer_pattern) if c == letter]
        for j in range(0, len(layers), g.group_size):
            members, views, offset = layers[j : j + g.group_size], [], 0
            for layer in members:
                if kind == "kda":
                    h, k = m.kda_heads, m.kda_head_dim
                    parts = [
                        ("state", [slots, h, k, k], KDA_STATE_DTYPE),
                        ("conv", [slots, 3 * h * k, m.conv_width - 1], g.kv_dtype),
                    ]
                else:
                    kv = [blocks, shards, g.block_size, m.attn_kv_heads, m.attn_head_dim]
                    parts = [("k", kv, g.kv_dtype), ("v", kv, g.kv_dtype)]
                for name, shape, dtype in parts:
                    views.append(LaunchView(layer=layer, name=name, offset=offset, shape=shape, dtype=dtype))
                    offset = _align(offset + math.prod(shape) * ITEMSIZE[dtype], g.alignment)
            out.append(
                LaunchGroup(
                    name=f"{kind}{j // g.group_size}",
                    kind=kind,  # type: ignore[arg-type]
                    layers=members,
                    span=span_of(kind, g),
                    nbytes=_align(offset + g.probe_bytes, g.alignment),
                    probe=KvRegion(offset=offset, nbytes=g.probe_bytes),
                    views=views,
                )
            )
    return out


def capture_sizes(max_num_seqs: int, num_spec: int) -> list[int]:
    """The graph sizes the harness asks for, in tokens: batches of 1, 2, 4, ... up to max_num_seqs
    requests of 1 + num_spec tokens each (what the capture check then demands a graph for)."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [n * (1 + num_spec) for n in [*sizes, max_num_seqs]]


def harness_geometry(req: RunRequest) -> KvGeometry:
    """The harness's own choices for a request (layer pattern, groups, blocks, DCP, capacities); the model
    dimensions in it are the reference preset's and are replaced by the engine's manifest."""
    g = GEOMETRY[req.preset]
    return g if req.dcp is None else replace(g, dcp_size=req.dcp, dcp_ranks=req.dcp)


# The reference engine's manifest name (qualify/engine/__main__.py): its seeded weights are the ones the
# harness hands over.
REFERENCE_ENGINE_NAME = "qualify-reference-engine"


def build(
    req: RunRequest,
    manifest: EngineManifest,
    target: str,
    *,
    weights_path: str,
    scratch_dir: str,
    weights_create: bool = True,
    weights_wait_s: float = 0.0,
    kda_backend: str | None = None,
    dcp: tuple[int, int] | None = None,
) -> LaunchDocument:
    """The document for this request. `dcp` = (dcp_size, dcp_ranks) overrides the request's (the DCP 1
    reference engine); `kda_backend` the backend (the refusal probe); `weights_wait_s` how long the engine
    waits for a handed file the harness may still be seeding when it starts. The manifest must name the
    preset."""
    h = harness_geometry(req)
    dims = manifest.presets[req.preset]
    size, ranks = dcp if dcp is not None else (h.dcp_size, h.dcp_ranks)
    geometry = LaunchGeometry(
        layer_pattern=h.layer_pattern,
        group_size=h.group_size,
        block_size=h.block_size,
        dcp_size=size,
        dcp_ranks=ranks,
        interleave=h.interleave,
        kv_dtype="bfloat16" if target == "gpu" else "float32",
    )
    capacity = LaunchCapacity(
        max_num_seqs=h.max_num_seqs,
        max_model_len=h.max_model_len,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        num_spec=req.num_spec,
        capture_sizes=capture_sizes(h.max_num_seqs, req.num_spec),
    )
    return LaunchDocument(
        protocol_version=SUPPORTED_PROTOCOL_VERSIONS[-1],
        preset=req.preset,
        model=dims,
        kda_decode_backend=kda_backend if kda_backend is not None else req.kda_backend,
        seed=0,
        geometry=geometry,
        capacity=capacity,
        kv_groups=kv_groups(geometry, capacity, dims),
        weights=LaunchWeights(path=weights_path, seed=0, create=weights_create, wait_s=weights_wait_s),
        scratch_dir=scratch_dir,
    )


def weights_name(manifest: EngineManifest, doc_preset: str, layer_pattern: str, dtype: str, seed: int) -> str:
    """A weights file name that changes with everything the weights' shapes follow from."""
    dims = manifest.presets[doc_preset].model_dump()
    key = hashlib.sha256(
        json.dumps([manifest.name, doc_preset, layer_pattern, dtype, dims], sort_keys=True).encode()
    ).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in manifest.name)[:40]
    return f"{safe}-{doc_preset}-{layer_pattern}-seed{seed}-{key}.safetensors"


def peer_geometry(doc: LaunchDocument) -> dict[str, Any]:
    """What the harness's peer reads (docs/PEER.md): the geometry, capacities and model dims the document
    sent, in the peer's flat form."""
    g, c, m = doc.geometry, doc.capacity, doc.model
    return {
        "layer_pattern": g.layer_pattern,
        "group_size": g.group_size,
        "block_size": g.block_size,
        "dcp_size": g.dcp_size,
        "dcp_ranks": g.dcp_ranks,
        "interleave": g.interleave,
        "max_num_seqs": c.max_num_seqs,
        "max_model_len": c.max_model_len,
        "num_spec": c.num_spec,
        "kda_heads": m.kda_heads,
        "kda_head_dim": m.kda_head_dim,
        "conv_width": m.conv_width,
        "attn_kv_heads": m.attn_kv_heads,
        "attn_head_dim": m.attn_head_dim,
        "dtype": g.kv_dtype,
        "alignment": g.alignment,
        "probe_bytes": g.probe_bytes,
    }


def sent_config(doc: LaunchDocument) -> dict[str, Any]:
    """The configuration keys `describe`'s `config` must report with the values sent (boot compares them)."""
    g, c = doc.geometry, doc.capacity
    return {
        "preset": doc.preset,
        "kda_decode_backend": doc.kda_decode_backend,
        "num_spec": c.num_spec,
        "layer_pattern": g.layer_pattern,
        "block_size": g.block_size,
        "dcp_size": g.dcp_size,
        "dcp_ranks": g.dcp_ranks,
        "max_num_seqs": c.max_num_seqs,
        "max_model_len": c.max_model_len,
    }


def document_digest(doc: LaunchDocument) -> str:
    """sha256 of the RFC 8785 bytes of the document (the receipt records it beside the document)."""
    return config_digest(doc.model_dump(mode="json"))


def parse_manifest(raw: bytes | None, command: str) -> tuple[EngineManifest | None, str | None]:
    """(manifest, None) or (None, one line saying why there is none)."""
    if not raw:
        return None, f"`{command}` printed no manifest"
    if len(raw) > MAX_MANIFEST_BYTES:
        return (
            None,
            f"`{command}` printed over {MAX_MANIFEST_BYTES} bytes; a manifest is one small JSON object",
        )
    line = next((ln for ln in reversed(raw.decode(errors="replace").splitlines()) if ln.startswith("{")), "")
    try:
        return EngineManifest.model_validate(json.loads(line)), None
    except (ValueError, ValidationError) as exc:
        first = str(exc).splitlines()
        return None, f"`{command}` did not print a valid manifest: {' '.join(first[:3])[:300]}"


def manifest_refusal(manifest: EngineManifest, preset: str, dcp: int | None = None) -> str | None:
    """Why the harness cannot launch this engine (one line), or None."""
    spoken = [v for v in manifest.protocol_versions if v in SUPPORTED_PROTOCOL_VERSIONS]
    if not spoken:
        return (
            f"engine {manifest.name} speaks protocol version(s) {manifest.protocol_versions}; this harness "
            f"speaks {list(SUPPORTED_PROTOCOL_VERSIONS)}"
        )
    if preset not in manifest.presets:
        have = sorted(manifest.presets)
        return f"engine {manifest.name} declares no model for preset {preset!r} (it has {have})"
    if dcp is not None and not manifest.dcp_distributed:
        return f"--dcp {dcp}: engine {manifest.name} declares no distributed DCP (dcp_distributed false)"
    return None
