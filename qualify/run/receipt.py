"""The receipt of a run: subjects, the qualification predicate, a DSSE signature, and the append.

Parts a run never reached stay null; nothing is invented. A local engine that never described itself is
identified by the harness's digest of the engine code on disk, and the receipt says that it was.
"""

from __future__ import annotations

import hashlib
import importlib.util
import platform
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from qualify import __version__
from qualify.errors import QualifyError
from qualify.run import weights_identity
from receipts import dsse
from receipts import statement as st
from receipts.keys import SigningKey
from receipts.store import Store

_SHA256_HEX = 64


def bare_hex(digest: str | None) -> str | None:
    """`sha256:<hex>` or `<hex>` -> `<hex>` when it is a sha256 digest, else None."""
    if not digest:
        return None
    h = digest.split(":", 1)[1] if digest.startswith("sha256:") else digest
    h = h.lower()
    return h if len(h) == _SHA256_HEX and all(c in "0123456789abcdef" for c in h) else None


def engine_code_digest_on_disk() -> str:
    """sha256 over the engine's source as the engine itself digests it (qualify.engine's code_digest): every
    .py under qualify/engine, qualify/protocol.py, qualify/shm.py and every .py under kernels/, sorted by
    path, each as (path relative to their common root, NUL, bytes, NUL). Found without importing the engine
    or kernels."""
    spec = importlib.util.find_spec("qualify.engine")
    if spec is None or not spec.submodule_search_locations:
        return "sha256:" + hashlib.sha256(b"qualify.engine not installed").hexdigest()
    engine_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    root = engine_dir.parent.parent
    kernels = importlib.util.find_spec("kernels")
    kernels_dir = (
        Path(next(iter(kernels.submodule_search_locations))).resolve()
        if kernels is not None and kernels.submodule_search_locations
        else root / "kernels"
    )
    own = [root / "qualify" / "protocol.py", root / "qualify" / "shm.py"]
    files = sorted([*engine_dir.rglob("*.py"), *own, *kernels_dir.rglob("*.py")])
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def module_source_digest(module: str) -> tuple[str | None, str]:
    """sha256 over the source of `module` (every .py of a package, sorted, as path NUL bytes NUL), found
    without importing it (its parent packages are imported); (None, why) when its source cannot be read."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return None, f"module {module} cannot be found: {exc}"
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None, f"module {module} has no Python source to hash"
    origin = Path(spec.origin).resolve()
    root = origin.parent
    files = sorted(root.rglob("*.py")) if spec.submodule_search_locations else [origin]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest(), f"module {module} ({len(files)} file(s) under {root})"


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes, read in chunks (weights files run to gigabytes)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def host_info() -> dict[str, Any]:
    os_name = platform.system()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "os": os_name,
        "kernel": platform.release(),
        "arch": platform.machine(),
    }


def subjects(
    engine: dict[str, Any], identity: dict[str, Any], weights_digest: str | None
) -> list[st.Subject]:
    """docker: the image digest; local: the engine code digest; both: the weights digests where the harness
    hashed the file it handed the engine, and the config digest."""
    out: list[st.Subject] = []
    if engine.get("image_digest"):
        name = identity.get("image") or "engine-image"
        out.append(st.Subject(name=str(name), digest={"sha256": bare_hex(engine["image_digest"])}))
    if engine.get("code_digest") and not engine.get("image_digest"):
        out.append(
            st.Subject(name=f"{engine['name']}-code", digest={"sha256": bare_hex(engine["code_digest"])})
        )
    if bare_hex(weights_digest):
        out.append(st.Subject(name=f"{engine['name']}-weights", digest={"sha256": bare_hex(weights_digest)}))
        # The same weights as OpenSSF model signing names them (its root digest of the one file).
        oms = bare_hex(weights_identity.root_of_one_file(str(bare_hex(weights_digest))))
        out.append(st.Subject(name=engine["name"] + weights_identity.SUBJECT_SUFFIX, digest={"sha256": oms}))
    out.append(
        st.Subject(name=f"{engine['name']}-config", digest={"sha256": bare_hex(engine["config_digest"])})
    )
    return out


def build_predicate(
    *,
    request: dict[str, Any],
    engine: dict[str, Any],
    backend: dict[str, Any] | None,
    layout: dict[str, Any] | None,
    checks: list[dict[str, Any]],
    faults: dict[str, Any],
    verdict: str,
    target: str,
    gpu: list[dict[str, Any]],
    driver: str | None,
    versions: dict[str, str],
    started_at: datetime,
    finished_at: datetime,
) -> st.QualificationPredicate:
    return st.QualificationPredicate(
        request=st.RequestInfo(**request),
        engine=st.EngineInfo(**engine),
        backend=st.BackendInfo(**backend) if backend else None,
        layout=st.LayoutInfo(**layout) if layout else None,
        checks=[st.CheckResult(**c) for c in checks],
        faults=st.Faults(**faults),
        verdict=verdict,  # type: ignore[arg-type]
        target=target,  # type: ignore[arg-type]
        host=st.HostInfo(**host_info()),
        gpu=[st.GpuInfo(**g) for g in gpu],
        driver=driver,
        versions=versions,
        started_at=started_at,
        finished_at=finished_at,
        qualify_version=__version__,
    )


class ReceiptNotStored(QualifyError):
    """The run finished and its receipt is signed, but the store refused or lost it: exit 1, not 0."""

    exit_code = 1


def sign_and_append(
    store: Store,
    key: SigningKey,
    predicate: st.QualificationPredicate,
    subj: list[st.Subject],
    save_to: Path | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Sign the statement (DSSE, in-toto payload) with the operator key and append it in one transaction.

    With `save_to`, the signed envelope is written there first, so a store that fails at the end of a run
    loses nothing: ReceiptNotStored names the file and the command that appends it later."""
    statement = st.build_statement(predicate, subj)
    envelope = dsse.sign(dsse.PAYLOAD_TYPE_INTOTO, st.statement_bytes(statement), key)
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        save_to.write_bytes(dsse.envelope_bytes(envelope))
    try:
        record = store.append_receipt(envelope)
    except Exception as exc:  # the store's own errors and a driver's lost connection alike
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        kept = (
            f"; the signed receipt is kept at {save_to}: append it with `qualify receipts import {save_to}`"
            if save_to is not None
            else ""
        )
        raise ReceiptNotStored(f"the store did not take the receipt ({line}){kept}") from exc
    return record, envelope
