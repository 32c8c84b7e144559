"""Operator signing keys (Ed25519, ECDSA P-256): generation, 0600 key files, signing and verification.

Key ids equal securesystemslib's default key ids, so DSSE envelopes interoperate with its verifier.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from securesystemslib.signer import SSlibKey

from receipts import sodium
from receipts.errors import KeyFileError, VerificationError

ALGORITHMS = ("ed25519", "p256")

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey

_ECDSA_SHA256 = ec.ECDSA(hashes.SHA256())


def _algorithm_of(key: PrivateKey | PublicKey) -> str | None:
    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return "ed25519"
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) and isinstance(
        key.curve, ec.SECP256R1
    ):
        return "p256"
    return None


def _require_supported(key: object, source: str) -> None:
    """KeyFileError unless the key read from `source` is ed25519 or p256."""
    if _algorithm_of(key) is None:  # type: ignore[arg-type]
        raise KeyFileError(f"{source} is a {type(key).__name__} key; only ed25519 and p256 are supported")


def _keyid(public: PublicKey) -> str:
    # securesystemslib: sha256 of OLPC-canonical {"keytype", "scheme", "keyval": {"public": ...}}.
    return SSlibKey.from_crypto(public).keyid


class VerifyingKey:
    """The public half of a signing key; what a verifier trusts."""

    def __init__(self, crypto: PublicKey) -> None:
        algorithm = _algorithm_of(crypto)
        if algorithm is None:
            raise ValueError(f"unsupported public key type {type(crypto).__name__}; use ed25519 or p256")
        self.crypto = crypto
        self.algorithm = algorithm
        self.keyid = _keyid(crypto)
        self._raw = (
            crypto.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            if isinstance(crypto, ed25519.Ed25519PublicKey)
            else None
        )

    def verify(self, signature: bytes, data: bytes) -> None:
        """Raise VerificationError unless `signature` (DER for P-256) is this key's signature of `data`."""
        if self._raw is not None and sodium.ed25519_valid(self._raw, signature, data):
            return  # libsodium's "valid" (see receipts.sodium); a refusal is OpenSSL's to decide
        try:
            if isinstance(self.crypto, ed25519.Ed25519PublicKey):
                self.crypto.verify(signature, data)
            else:
                self.crypto.verify(signature, data, _ECDSA_SHA256)
        except (InvalidSignature, ValueError) as exc:
            raise VerificationError(
                f"signature does not verify with {self.algorithm} key {self.keyid}"
            ) from exc

    def public_pem(self) -> bytes:
        """SubjectPublicKeyInfo PEM, the form `qualify keys export-public` writes and `trust` reads."""
        return self.crypto.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def to_sslib(self) -> SSlibKey:
        """The same key as a securesystemslib `SSlibKey` (same keyid)."""
        return SSlibKey.from_crypto(self.crypto)

    @classmethod
    def from_pem(cls, data: bytes, source: str = "public key") -> VerifyingKey:
        """Parse a PEM public key; KeyFileError (naming `source`) unless it is an ed25519/p256 key."""
        if b"PRIVATE KEY" in data:
            raise KeyFileError(
                f"{source} holds a private key; trust only its public half (qualify keys export-public)"
            )
        try:
            crypto = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(f"{source} is not a PEM public key; expected an ed25519 or p256 key") from exc
        _require_supported(crypto, source)
        return cls(crypto)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> VerifyingKey:
        """Read a PEM public key file; KeyFileError when missing, unreadable or not a supported key."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise KeyFileError(f"public key file {path} does not exist") from exc
        except OSError as exc:
            raise KeyFileError(f"cannot read public key file {path}: {exc.strerror}") from exc
        return cls.from_pem(data, source=f"public key file {path}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerifyingKey) and other.keyid == self.keyid

    def __hash__(self) -> int:
        return hash(self.keyid)

    def __repr__(self) -> str:
        return f"VerifyingKey({self.algorithm}, keyid={self.keyid[:16]}…)"


class SigningKey:
    """A private key that signs receipts. Never printed; written only to 0600 files."""

    def __init__(self, crypto: PrivateKey) -> None:
        algorithm = _algorithm_of(crypto)
        if algorithm is None:
            raise ValueError(f"unsupported private key type {type(crypto).__name__}; use ed25519 or p256")
        self.crypto = crypto
        self.algorithm = algorithm
        self._public = VerifyingKey(crypto.public_key())
        self.keyid = self._public.keyid

    def public_key(self) -> VerifyingKey:
        return self._public

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature, or a DER-encoded ECDSA P-256/SHA-256 signature (as DSSE and cosign expect)."""
        if isinstance(self.crypto, ed25519.Ed25519PrivateKey):
            return self.crypto.sign(data)
        return self.crypto.sign(data, _ECDSA_SHA256)

    def private_pem(self) -> bytes:
        """Unencrypted PKCS#8 PEM; protect it with file permissions (see `save`)."""
        return self.crypto.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the key to `path` with mode 0600, atomically; parent dirs are created 0700.

        Refuses (KeyFileError) to replace an existing file unless `overwrite=True`.
        """
        path = Path(path)
        if path.exists() and not overwrite:
            raise KeyFileError(f"key file {path} already exists; refusing to overwrite it")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # mkstemp creates the file 0600 from the start, so the key is never readable by others,
            # even for an instant; the rename then makes it appear whole or not at all.
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        except OSError as exc:
            raise KeyFileError(f"cannot create key file {path}: {exc.strerror}") from exc
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o600)
                fh.write(self.private_pem())
                fh.flush()
                os.fsync(fh.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                # link() fails if the name appeared meanwhile, unlike rename(), which would clobber it.
                os.link(tmp, path)
                os.unlink(tmp)
        except FileExistsError as exc:
            raise KeyFileError(f"key file {path} already exists; refusing to overwrite it") from exc
        except OSError as exc:
            raise KeyFileError(f"cannot write key file {path}: {exc.strerror}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return path

    @classmethod
    def from_pem(cls, data: bytes, source: str = "private key") -> SigningKey:
        """Parse an unencrypted PEM private key; KeyFileError when it is not an ed25519/p256 private key."""
        try:
            crypto = serialization.load_pem_private_key(data, password=None)
        except TypeError as exc:  # cryptography raises TypeError for a password-protected key
            raise KeyFileError(f"{source} is encrypted; qualify needs an unencrypted PKCS#8 key") from exc
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise KeyFileError(
                f"{source} is not a PEM private key; create one with: qualify keys generate"
            ) from exc
        _require_supported(crypto, source)
        return cls(crypto)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Read a private key file, refusing one that group or others can read."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise KeyFileError(
                f"key file {path} does not exist; create one with: qualify keys generate"
            ) from exc
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from exc
        try:
            # fstat on the open descriptor: the mode checked is the mode of the bytes read.
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise KeyFileError(f"key file {path} is not a regular file")
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o077:
                raise KeyFileError(
                    f"key file {path} is readable by group/others (mode {mode:04o}); run: chmod 600 {path}"
                )
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        except OSError as exc:
            raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        data = b"".join(chunks)
        return cls.from_pem(data, source=f"key file {path}")

    def __repr__(self) -> str:
        return f"SigningKey({self.algorithm}, keyid={self.keyid[:16]}…)"


def generate(algorithm: str = "ed25519") -> SigningKey:
    """A fresh key: "ed25519" (default) or "p256" (ECDSA P-256 with SHA-256)."""
    if algorithm == "ed25519":
        return SigningKey(ed25519.Ed25519PrivateKey.generate())
    if algorithm == "p256":
        return SigningKey(ec.generate_private_key(ec.SECP256R1()))
    raise ValueError(f"unknown key algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")
