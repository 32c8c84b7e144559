"""The weights' identity as OpenSSF model signing (`model-signing`, github.com/sigstore/model-transparency)
computes it, so that a receipt's weights subject is the digest a model's own signature names.

model-signing (v1, file serialization, sha256 — its defaults) hashes every regular file under the model
path, sorts them by their path relative to it (component by component), and takes as the root digest
sha256 over the concatenated raw file digests. Its signed statement's one subject is that root digest,
named after the model path's last component. For a model that is one file, the relative path is "." and
the root is sha256(sha256(file bytes)). Ignored as model-signing ignores them by default: `.git/`,
`.github/`, `.gitattributes` and `.gitignore` at the top; a symbolic link is refused, as model-signing
refuses one unless told to follow it.

This module never imports model-signing (the harness does not depend on it); tests/formats checks these
digests with model-signing itself, signing and verifying with it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

CHUNK = 1 << 22
SUBJECT_SUFFIX = "-weights-model-signing"
_IGNORED_AT_TOP = (".git", ".github", ".gitattributes", ".gitignore")


def _file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    return h.digest()


def root_from_file_digests(digests: dict[PurePosixPath, bytes]) -> str:
    """sha256 over the raw file digests in model-signing's order (by path components), as sha256:<hex>."""
    h = hashlib.sha256()
    for relative in sorted(digests, key=lambda p: p.parts):
        h.update(digests[relative])
    return "sha256:" + h.hexdigest()


def root_of_one_file(file_sha256: str) -> str:
    """The model-signing root digest of a model that is the one file whose sha256 is given (sha256:<hex>
    or bare hex): computed from the digest the harness already took, without reading the file again."""
    return root_from_file_digests({PurePosixPath("."): bytes.fromhex(file_sha256.removeprefix("sha256:"))})


def model_signing_digest(model_path: str | Path) -> str:
    """The root digest model-signing computes for `model_path` (a file or a directory), sha256:<hex>.
    ValueError for a symbolic link or anything but regular files and directories."""
    root = Path(model_path)
    if root.is_symlink():
        raise ValueError(f"{root} is a symbolic link; model signing refuses those by default")
    if root.is_file():
        return root_from_file_digests({PurePosixPath("."): _file_sha256(root)})
    if not root.is_dir():
        raise ValueError(f"{root} is neither a file nor a directory")
    digests: dict[PurePosixPath, bytes] = {}
    for path in root.rglob("*"):
        relative = PurePosixPath(path.relative_to(root).as_posix())
        if relative.parts[0] in _IGNORED_AT_TOP:
            continue
        if path.is_symlink():
            raise ValueError(f"{path} is a symbolic link; model signing refuses those by default")
        if path.is_file():
            digests[relative] = _file_sha256(path)
        elif not path.is_dir():
            raise ValueError(f"{path} is neither a file nor a directory")
    return root_from_file_digests(digests)
