"""Verify bin-map artifacts and load them from files or HTTP (part of :mod:`lpcal.client`).

:func:`verify_artifact` classifies every failure under one of :data:`REJECT_REASONS`
(:class:`BinMapRejected`); :func:`load_file`, :func:`fetch_http` and :func:`load_http` name the
file or URL in their errors (:class:`BinMapLoadError` when the map cannot be read). The
acceptance rules of :meth:`lpcal.client.BinMapStore.offer` are in :mod:`lpcal.client.store`.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from lpcal.binmap import READABLE_SCHEMAS, BinMap
from lpcal.errors import ArtifactError, InputError, LpcalError
from lpcal.signing import KeyRing, SignatureError

REJECT_REASONS: tuple[str, ...] = ("checksum", "truncated", "schema", "parse", "model",
                                   "signature")
"""Bounded reasons under which :class:`BinMapStore` counts rejected artifacts."""


# --------------------------------------------------------------------------- errors


class BinMapRejected(ArtifactError):
    """An artifact failed verification; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BinMapLoadError(LpcalError, OSError):
    """A bin map could not be read (missing file, HTTP error, connection failure, timeout)."""


class UnknownModelError(LpcalError, LookupError):
    """``apply`` was called for a model that has no bin map in the store."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """What :class:`BinMapStore` hands to ``on_reject`` for every rejected artifact."""

    reason: str
    model: str | None
    source: str
    message: str


# --------------------------------------------------------------------------- verification


def _verify(data: bytes | bytearray | memoryview | str, where: str,
            ring: KeyRing | None = None) -> tuple[BinMap, str]:
    """``(bin map, checksum)`` or :class:`BinMapRejected` with the reason classified."""
    if isinstance(data, str):
        data = data.encode()
    data = bytes(data)
    if not data:
        raise BinMapRejected("truncated", f"{where}: empty artifact (0 bytes)")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        if e.pos >= len(data) or "end of data" in e.msg:
            raise BinMapRejected("truncated", f"{where}: truncated artifact: JSON ends early "
                                 f"after {len(data)} bytes ({e.msg})") from None
        raise BinMapRejected("parse", f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BinMapRejected("parse", f"{where}: top level must be a JSON object, "
                             f"got {type(obj).__name__}")
    schema = obj.get("schema")
    if schema not in READABLE_SCHEMAS or isinstance(schema, bool):
        raise BinMapRejected("schema", f"{where}: incompatible schema {schema!r}; this lpcal "
                             f"reads schemas {', '.join(map(str, READABLE_SCHEMAS))}")
    checksum = obj.get("checksum")
    if not isinstance(checksum, str):
        raise BinMapRejected("checksum", f"{where}: missing checksum")
    try:
        bm = BinMap.from_json(data, where=where, public_keys=ring)
    except SignatureError as e:
        raise BinMapRejected("signature", str(e)) from None
    except ArtifactError as e:
        content = {k: v for k, v in obj.items() if k != "checksum"}
        try:
            intact = BinMap._digest(content) == checksum
        except (TypeError, orjson.JSONEncodeError):
            intact = False
        raise BinMapRejected("parse" if intact else "checksum", str(e)) from None
    return bm, checksum


def verify_artifact(data: bytes | str, *, where: str = "bin map",
                    public_keys: Any = None) -> BinMap:
    """Verify and load an artifact; raises :class:`BinMapRejected` (an ``ArtifactError``) whose
    ``reason`` is one of ``truncated | parse | schema | checksum | signature``.

    ``public_keys``: a :class:`KeyRing` or what it takes (PEM, raw or base64 keys, key files);
    when given, a valid signature by one of them is required (``signature`` otherwise)."""
    return _verify(data, where, KeyRing.of(public_keys))[0]


# --------------------------------------------------------------------------- loaders


def load_file(path: str | os.PathLike, *, public_keys: Any = None) -> BinMap:
    """Load and verify a bin map JSON file (``public_keys`` as in :func:`verify_artifact`).
    Errors name the file: :class:`BinMapLoadError` when it cannot be read,
    :class:`BinMapRejected` when its content is not a valid (or not an authentic) artifact."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BinMapLoadError(f"{p}: cannot read bin map file ({e.strerror or e})") from e
    return verify_artifact(data, where=str(p), public_keys=public_keys)


def fetch_http(url: str, timeout: float = 10.0, *,
               headers: Mapping[str, str] | None = None) -> bytes:
    """GET ``url`` (e.g. the daemon's ``/v1/models/{model}/binmap``) and return the body bytes.

    Raises :class:`BinMapLoadError` naming the URL on an HTTP status other than 200 (with the
    start of the body, e.g. the daemon's 404 ``no bin map for this model``), a connection
    failure or a timeout, and :class:`BinMapRejected` (``truncated``) when the connection closes
    before ``Content-Length`` bytes arrived.
    """
    if timeout is None or not timeout > 0:
        raise InputError(f"fetch_http: timeout must be > 0 seconds, got {timeout!r}")
    req = urllib.request.Request(url, headers={"Accept": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            body = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode("utf-8", "replace").strip()
        raise BinMapLoadError(f"{url}: HTTP {e.code} {e.reason}"
                              + (f": {detail}" if detail else "")) from e
    except http.client.IncompleteRead as e:
        raise BinMapRejected("truncated", f"{url}: truncated response: {len(e.partial)} bytes "
                             f"received, {e.expected} more expected") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise BinMapLoadError(f"{url}: cannot fetch bin map ({reason})") from e
    if status != 200:
        raise BinMapLoadError(f"{url}: HTTP {status}, expected 200")
    return body


def load_http(url: str, timeout: float = 10.0, *,
              headers: Mapping[str, str] | None = None, public_keys: Any = None) -> BinMap:
    """Fetch (:func:`fetch_http`) and verify a bin map (``public_keys`` as in
    :func:`verify_artifact`); errors name the URL."""
    return verify_artifact(fetch_http(url, timeout, headers=headers), where=url,
                           public_keys=public_keys)
