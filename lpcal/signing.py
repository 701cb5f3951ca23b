"""Ed25519 signatures of bin maps (the ``cryptography`` package; no hand-written crypto).

A signed bin map is still one JSON document: the top-level field ::

    "signature": {"alg": "ed25519", "key_id": "<first 16 hex of sha256(raw public key)>",
                  "sig": "<base64 of the 64-byte Ed25519 signature>"}

signs the canonical JSON (sorted keys, orjson) of every other field except ``checksum``, i.e.
exactly the bytes whose sha256 is the checksum of an unsigned map. The ``checksum`` of a signed
map then covers the content *and* the signature, so readers that do not verify signatures
(lpcal 0.1, or lpcal without a key) load signed maps unchanged.

Keys:

* private key (the daemon, :class:`Signer`): PEM (PKCS#8, unencrypted: ``openssl genpkey
  -algorithm ed25519``), the raw 32-byte seed, or the base64 text of that seed;
* public keys (clients and the daemon, :class:`KeyRing`): PEM (SubjectPublicKeyInfo: ``openssl
  pkey -in key.pem -pubout``), the raw 32 bytes, their base64 text, an ``Ed25519PublicKey``, or
  a path to a file holding one of these. A ring holds one or more keys (rotation: the old and
  the new key while maps signed by the old one are still in use).

``lpcal keygen DIR`` (or ``python -m lpcal.signing DIR``, :func:`keygen`) writes a new key pair:
``DIR/signing__private_key`` (mode 0600), the file the daemon reads from its secrets directory,
and ``DIR/binmap-signing.pub`` for the clients; it prints the key id and the next steps.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from lpcal.errors import ArtifactError

__all__ = ["ALG", "PRIVATE_KEY_FILE", "PUBLIC_KEY_FILE", "KeyRing", "SignatureError", "Signer",
           "canonical", "generate_keypair", "key_id", "keygen", "load_private_key",
           "load_public_key"]

ALG = "ed25519"
KEY_ID_HEX = 16


class SignatureError(ArtifactError):
    """A bin map is unsigned, signed by an unknown key, or its signature does not verify."""


def canonical(content: dict) -> bytes:
    """The bytes that are checksummed and signed: sorted-key orjson of ``content``."""
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS)


def _raw_public(pk: Ed25519PublicKey) -> bytes:
    return pk.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Any) -> str:
    """Short id of a public key (any form :func:`load_public_key` takes)."""
    return hashlib.sha256(_raw_public(load_public_key(key))).hexdigest()[:KEY_ID_HEX]


def _as_bytes(src: Any) -> bytes:
    if isinstance(src, os.PathLike):
        return Path(src).read_bytes()
    if isinstance(src, str):
        return src.encode()
    return bytes(src)


def _b64_32(data: bytes) -> bytes | None:
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def load_private_key(src: Any) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM (PKCS#8), the raw 32-byte seed or its base64 text;
    ``ValueError`` otherwise."""
    if isinstance(src, Ed25519PrivateKey):
        return src
    data = _as_bytes(src)
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_private_key(data.strip() + b"\n", password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a PEM Ed25519 private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"not an Ed25519 private key (a {type(key).__name__})")
        return key
    raw = data if len(data) == 32 else _b64_32(data)
    if raw is None:
        raise ValueError("not an Ed25519 private key: expected PEM (PKCS#8), 32 raw bytes or "
                         "their base64 text")
    return Ed25519PrivateKey.from_private_bytes(raw)


def load_public_key(src: Any) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM, 32 raw bytes, their base64 text, a key object or a file
    path (``os.PathLike``); ``ValueError`` otherwise."""
    if isinstance(src, Ed25519PublicKey):
        return src
    where = f" in {src}" if isinstance(src, os.PathLike) else ""
    data = _as_bytes(src)
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data.strip() + b"\n")
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a PEM Ed25519 public key{where} ({e})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"not an Ed25519 public key{where} (a {type(key).__name__})")
        return key
    raw = data if len(data) == 32 else _b64_32(data)
    if raw is None:
        raise ValueError(f"not an Ed25519 public key{where}: expected PEM, 32 raw bytes or "
                         f"their base64 text")
    return Ed25519PublicKey.from_public_bytes(raw)


class Signer:
    """Signs bin-map content with one private key (see the module docstring)."""

    def __init__(self, private_key: Any):
        self._sk = load_private_key(private_key)
        self.public_key = self._sk.public_key()
        self.key_id = key_id(self.public_key)

    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)

    def sign(self, message: bytes) -> dict:
        """The ``signature`` field for ``message`` (the canonical content bytes)."""
        return {"alg": ALG, "key_id": self.key_id,
                "sig": base64.b64encode(self._sk.sign(message)).decode()}

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id!r})"


class KeyRing:
    """One or more trusted public keys, by key id (see the module docstring)."""

    def __init__(self, keys: Iterable[Any]):
        if isinstance(keys, (str, bytes, os.PathLike, Ed25519PublicKey)):
            keys = [keys]
        self._keys: dict[str, Ed25519PublicKey] = {}
        for k in keys:
            pk = load_public_key(k)
            self._keys[key_id(pk)] = pk
        if not self._keys:
            raise ValueError("a key ring needs at least one public key")

    @classmethod
    def of(cls, keys: Any) -> KeyRing | None:
        """``keys`` as a ring: None or an empty collection give None (nothing verified)."""
        if keys is None or isinstance(keys, KeyRing):
            return keys
        if isinstance(keys, (list, tuple, set, frozenset)) and not keys:
            return None
        return cls(keys)

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(self._keys)

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def verify(self, message: bytes, signature: Any, where: str = "bin map") -> str:
        """Key id of the trusted key whose signature over ``message`` is ``signature``;
        :class:`SignatureError` saying why not."""
        if signature is None:
            raise SignatureError(f"{where}: unsigned, but a signature by one of the keys "
                                 f"{list(self._keys)} is required")
        if not isinstance(signature, dict) or signature.get("alg") != ALG:
            alg = signature.get("alg") if isinstance(signature, dict) else None
            raise SignatureError(f"{where}: signature algorithm {alg!r} is not {ALG!r}")
        kid = signature.get("key_id")
        pk = self._keys.get(kid) if isinstance(kid, str) else None
        if pk is None:
            raise SignatureError(f"{where}: signed by key id {kid!r}, which is not trusted "
                                 f"(trusted: {list(self._keys)})")
        try:
            sig = base64.b64decode(str(signature.get("sig", "")), validate=True)
            pk.verify(sig, message)
        except (binascii.Error, ValueError, InvalidSignature):
            raise SignatureError(f"{where}: bad signature for key id {kid!r} (forged or "
                                 f"tampered)") from None
        return kid

    def __repr__(self) -> str:
        return f"KeyRing({list(self._keys)})"


def generate_keypair() -> tuple[bytes, bytes]:
    """A new ``(private PEM (PKCS#8), public PEM)`` pair."""
    sk = Ed25519PrivateKey.generate()
    return (sk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()),
            sk.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo))


PRIVATE_KEY_FILE = "signing__private_key"
"""Name of the private-key file: the daemon's setting ``signing.private_key`` read from its
secrets directory (``daemon.settings``: one file per setting, sections joined by ``__``)."""
PUBLIC_KEY_FILE = "binmap-signing.pub"
"""Name of the public-key file that clients are given (``--public-key``, ``public_keys=``)."""


def keygen(directory: str | os.PathLike) -> tuple[Path, Path, str]:
    """Write a new key pair for the daemon: ``(private key file, public key file, key id)``.

    ``directory/signing__private_key`` (PEM PKCS#8, mode 0600) is the file the daemon reads from
    its secrets directory; ``directory/binmap-signing.pub`` (PEM) is for the clients. The
    directory is created (mode 0700) if its parent exists.

    Raises
    ------
    ArtifactError
        Either file exists already (keys are never overwritten), or a file cannot be written.
    """
    d = Path(directory)
    kp, pp = d / PRIVATE_KEY_FILE, d / PUBLIC_KEY_FILE
    present = [str(f) for f in (kp, pp) if f.exists() or f.is_symlink()]
    if present:
        raise ArtifactError(f"{' and '.join(present)} already exist{'s' * (len(present) == 1)}"
                            ": keys are never overwritten; move them away or choose another "
                            "directory")
    if not d.parent.is_dir():
        raise ArtifactError(f"{d}: directory {str(d.parent)!r} does not exist (create it first)")
    priv, pub = generate_keypair()
    written: list[Path] = []
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        for path, data, mode in ((kp, priv, 0o600), (pp, pub, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            written.append(path)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
    except OSError as e:
        for path in written:
            path.unlink(missing_ok=True)
        raise ArtifactError(f"{e.filename or d}: cannot write ({e.strerror or e})") from None
    return kp, pp, key_id(pub)


def next_steps(private: Path, public: Path) -> str:
    """What to do with the files :func:`keygen` wrote (printed by ``lpcal keygen``)."""
    private, public = private.absolute(), public.absolute()
    return (
        "next steps:\n"
        f"  1. daemon: make {private.parent} its secrets directory (LPCAL_SECRETS_DIR="
        f"{private.parent} lpcal serve), or in Kubernetes put {private.name} in the Secret "
        "mounted at /var/run/secrets/lpcal (deploy/README.md: kubectl create secret generic "
        f"lpcal-signing --from-file={PRIVATE_KEY_FILE}={private})\n"
        f"  2. clients: give them {public} (lpcal apply/eval --public-key {public}; "
        "BinMapStore(public_keys=[...]), lpcal/CLIENT.md)")


def main(argv: list[str] | None = None, prog: str = "python -m lpcal.signing") -> int:
    """``lpcal keygen DIR`` (also ``python -m lpcal.signing DIR``): write a key pair, print the
    key id and the next steps. Exit 0, or 2 with a one-line error (keys exist, cannot write)."""
    import argparse

    ap = argparse.ArgumentParser(
        prog=prog, description=f"Write a new Ed25519 key pair for signing bin maps: DIR/"
        f"{PRIVATE_KEY_FILE} (mode 0600, the file the daemon reads from its secrets directory) "
        f"and DIR/{PUBLIC_KEY_FILE} (for the clients). Existing keys are never overwritten.")
    ap.add_argument("dir", metavar="DIR", help="directory for the two files (created if "
                                               "missing, mode 0700)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        kp, pp, kid = keygen(a.dir)
    except ArtifactError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {kp} (private key, mode 0600) and {pp} (public key); key id {kid}")
    print(next_steps(kp, pp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
