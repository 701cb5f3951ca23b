"""The bin map: an immutable, versioned, checksummed artifact mapping raw predictions to calibrated.

``h(x) = pred(S)`` for the group ``S in G`` holding ``R(f(x))`` when ``R(f(x)) in B``; otherwise the
fallback ``rho(R(f(x)))`` (the paper) or ``f(x)`` itself (``outside="identity"``). If the bin map
carries a pre-scaling temperature ``T``, ``f`` is first replaced by ``softmax(log f / T)``.

JSON layout (schema 2; orjson; UTF-8)::

    {"schema": 2, "model_id", "version", "created_at", "eps", "p" ("inf" for infinity), "delta",
     "beta", "lam", "k", "temperature" (null if none), "outside", "sizing", "iterations",
     "stop_reason", "est_error", "n_bins", "n_groups",
     "bins": [canonical sparse keys of B], "group": [group of each bin],
     "preds": [{"d": default, "i": [indices], "v": [values]} per group],
     "mode": "certified" | "paper",
     "certificate": null | {"method", "eps", "p", "lam", "delta", "n_holdout",
                            "estimates": {candidate: {"err_p", "bound", "brier"}},
                            "selected", "certified", "selectable", "vacuous"}
                     (:meth:`lpcal.certificate.Certificate.to_dict`; ``BinMap.certificate`` is
                     the :class:`~lpcal.certificate.Certificate`),
     "floor": {"eta", "classes"} (absent in maps of lpcal versions without the floor),
     "signature": {"alg": "ed25519", "key_id", "sig"} (only in signed maps),
     "checksum": "sha256:<hex>"}

Schema 1 (lpcal 0.1) had neither ``mode`` nor ``certificate``; it is still read (as
``mode = "paper"`` without a certificate). A map whose certificate selected the pre-calibrator
alone has no bins (``B`` empty, ``outside = "identity"``): it is temperature scaling, certified.

``floor`` is the probability floor (:func:`lpcal.calibrate.probability_floor`): every output row
with an exact 0 on one of ``classes`` (the classes seen in the fit sample) is mixed with ``eta``
on each of them, so the map never outputs 0 for a class that has occurred. Readers that do not
know the field (older lpcal) load the map and apply it without the floor.

Predictions are stored sparsely: every coordinate equals ``d`` except those listed. The checksum
is the sha256 of the canonical JSON (sorted keys) of every other field, so any corruption,
truncation or tampering is detected on load. The checksum has no key, so it does not prove who
wrote the map: the daemon also signs it (Ed25519, :mod:`lpcal.signing`). The optional
``signature`` field signs the canonical JSON of every field but ``checksum`` and ``signature``
(the bytes an unsigned map's checksum is computed over); the checksum of a signed map covers the
signature too, so readers that verify no signature (and lpcal 0.1) load signed maps unchanged.
``from_json(data, public_keys=...)`` requires a valid signature by one of the keys.

``version`` is an integer in ``[0, MAX_VERSION]`` (``2**53 - 1``: exact in every JSON reader and
in a float64, and within the 64-bit integers of the daemon's checkpoints); anything else is
rejected on load and on save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from lpcal.certificate import Certificate
from lpcal.errors import ArtifactError, InputError
from lpcal.kernels import ApplyPlan, scale_temperature  # noqa: F401 (re-exported)
from lpcal.levels import BinIndex, decode_keys
from lpcal.simplex import lift_zeros
from lpcal.spec import Mode, Outside

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
MAX_VERSION = 2 ** 53 - 1
"""Largest bin-map version (the largest integer exact in a float64 and in JSON readers)."""


def _check_version(v: Any, where: str = "bin map") -> int:
    """``v`` if it is an integer in ``[0, MAX_VERSION]`` (not a bool or a float), else
    :class:`ArtifactError`."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= MAX_VERSION:
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise ArtifactError(f"{where}: version must be an integer in [0, 2**53 - 1], got "
                            f"{shown}")
    return int(v)


def _encode_pred(row: np.ndarray) -> dict:
    vals, counts = np.unique(row, return_counts=True)
    d = float(vals[np.argmax(counts)])
    idx = np.flatnonzero(row != d)
    return {"d": d, "i": idx.tolist(), "v": row[idx].tolist()}


def _decode_pred(obj: Any, k: int, g: int) -> np.ndarray:
    try:
        row = np.full(k, float(obj["d"]))
        idx = np.asarray(obj["i"], dtype=np.int64)
        val = np.asarray(obj["v"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"preds[{g}] is malformed ({e})") from None
    if idx.shape != val.shape or idx.ndim != 1:
        raise ArtifactError(f"preds[{g}]: index and value lists differ in length")
    if idx.size and (idx.min() < 0 or idx.max() >= k):
        raise ArtifactError(f"preds[{g}]: class index outside [0, {k})")
    row[idx] = val
    return row


@dataclasses.dataclass(frozen=True, eq=False)
class BinMap:
    """A fitted calibrator ``h`` (see the module docstring). Build with ``lpcal.fit``/``fit_pools``.

    Attributes are the JSON fields of the module docstring; ``bins``, ``group`` and ``preds``
    (read-only arrays) describe ``B`` and its groups, ``temperature`` the pre-calibrator and
    ``certificate`` the held-out evaluation (a :class:`lpcal.certificate.Certificate`, written
    as its :meth:`~lpcal.certificate.Certificate.to_dict`). ``mode`` and ``outside`` are the
    values of :class:`lpcal.spec.Mode` and :class:`lpcal.spec.Outside`.

    Examples
    --------
    >>> import math, numpy as np
    >>> from lpcal import fit, BinMap
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(5000, 3)) * 3
    >>> f = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    >>> y = (f.cumsum(axis=1) > rng.random(5000)[:, None]).argmax(axis=1)
    >>> bm = fit(f, y, eps=0.1, p=math.inf, model_id="fraud-v3")
    >>> h = bm.apply(f[:2])
    >>> h.shape, bool(np.allclose(h.sum(axis=1), 1.0))
    ((2, 3), True)
    >>> BinMap.from_json(bm.to_json()).checksum == bm.checksum   # verified on load
    True
    """

    model_id: str
    version: int
    created_at: str
    eps: float
    p: float
    delta: float
    beta: float
    lam: int
    k: int
    temperature: float | None
    outside: str
    sizing: dict
    iterations: int
    stop_reason: str
    est_error: dict
    bins: tuple[str, ...]
    group: np.ndarray  # (|B|,) int
    preds: np.ndarray  # (|G|, k) float
    mode: str = "paper"
    certificate: Certificate | None = None
    floor: dict | None = None  # {"eta", "classes"}: the probability floor (lpcal.calibrate)
    bin_rows: dataclasses.InitVar[np.ndarray | None] = None  # rows of ``bins``, if known

    def __post_init__(self, bin_rows: np.ndarray | None):
        object.__setattr__(self, "outside", _enum_value(Outside, "outside", self.outside))
        object.__setattr__(self, "mode", _enum_value(Mode, "mode", self.mode))
        if self.temperature is not None and not (
                isinstance(self.temperature, float) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ArtifactError(f"temperature must be positive and finite, got "
                                f"{self.temperature!r}")
        if self.certificate is not None and not isinstance(self.certificate, Certificate):
            raise ArtifactError(f"certificate must be a lpcal.certificate.Certificate or None, "
                                f"got {type(self.certificate).__name__} (Certificate.from_dict "
                                "reads its JSON form)")
        object.__setattr__(self, "_floor", _floor_mask(self.floor, self.k))
        # callers that built ``bins`` from their rows (fit_pools) pass them, saving the parse
        rows = decode_keys(self.bins, self.k, self.lam) if bin_rows is None else bin_rows
        object.__setattr__(self, "_index", BinIndex(rows))
        g = np.asarray(self.group, dtype=np.int64)
        P = np.asarray(self.preds, dtype=np.float64)
        if g.shape != (len(self.bins),):
            raise ArtifactError(f"group has {g.size} entries for {len(self.bins)} bins")
        if P.ndim != 2 or (P.size and P.shape[1] != self.k):
            raise ArtifactError(f"preds must have shape (groups, {self.k}), got {P.shape}")
        if g.size and (g.min() < 0 or g.max() >= P.shape[0]):
            raise ArtifactError("group id outside the range of preds")
        if P.size and (not np.isfinite(P).all() or P.min() < 0
                       or np.abs(P.sum(axis=1) - 1).max() > 1e-9):
            raise ArtifactError("a group prediction is not a probability vector")
        g.setflags(write=False)
        P.setflags(write=False)
        object.__setattr__(self, "group", g)
        object.__setattr__(self, "preds", P)
        bin_pred = P[g] if g.size else np.zeros((0, self.k))
        bin_pred.setflags(write=False)
        object.__setattr__(self, "_bin_pred", bin_pred)
        # everything apply needs, built once: the single-row dict of B, hash weights, constants
        object.__setattr__(self, "_plan", ApplyPlan(self.k, self.lam, self.temperature,
                                                    self.outside == "rho", self._index, bin_pred))

    # ------------------------------------------------------------------ apply
    @property
    def n_bins(self) -> int:
        return len(self.bins)

    @property
    def n_groups(self) -> int:
        return int(self.preds.shape[0])

    def apply(self, probs: np.ndarray, *, check: bool = True,
              out: np.ndarray | None = None) -> np.ndarray:
        """Calibrated probabilities ``h(x)`` for rows of raw probabilities ``f(x)`` (vectorised).

        Parameters
        ----------
        probs : array_like, shape (n, k) or (k,)
            Raw probability rows ``f(x)`` (converted to float64).
        check : bool, default True
            Validate every row: finite, non-negative, summing to 1 within 1e-3; the first bad
            row raises :class:`InputError` naming it. ``check=False`` skips exactly these three
            tests of the row contents and nothing else: the shapes of ``probs`` and ``out`` are
            still checked, rows are still renormalised when their sums are far enough from 1 to
            move a bin boundary, and the arithmetic is the same. Rows that would have failed
            then give unspecified output (e.g. NaN) instead of an error. Use it when the rows
            come straight from a softmax you trust.
        out : numpy.ndarray, optional
            Writeable float64 array of the shape of ``probs`` to write the result into (no
            allocation of the result); it may be ``probs`` itself (in place), but must not
            otherwise overlap it. Returned.

        Returns
        -------
        numpy.ndarray
            ``h(x)``, of the shape of ``probs`` (``out`` when given).

        Notes
        -----
        Batches run in cache-resident chunks of rows (:mod:`lpcal.kernels`): temperature scaling
        (``exp(log f / T)``, normalised, in place), then for maps with bins: bin, hash, look up in
        ``B``, write the group prediction or the fallback. A map that is the temperature alone
        (``B`` empty, ``outside="identity"``) costs what temperature scaling costs. A single
        row (shape ``(k,)`` or ``(1, k)``) takes a dedicated path that looks its bin up in a
        ``dict`` built when the map was loaded; it returns the batch path's values (rows in
        ``B`` exactly their group's prediction, other rows up to the rounding of a row sum,
        about 1e-16). If a row fails the check, ``out`` may already hold earlier rows' results.
        Last, a map with a ``floor`` lifts every output row with an exact 0 on one of its
        classes (one reduction over the output; the module docstring).
        """
        u = np.asarray(probs, dtype=np.float64)
        k = self.k
        if not (u.ndim in (1, 2) and u.shape[-1] == k):
            raise InputError(f"expected probability rows of length {k}, got shape "
                             f"{np.atleast_2d(u).shape}")
        o, inplace = (np.empty(u.shape), False) if out is None else _out_buffer(u, out)
        if u.ndim == 1:
            self._plan.apply_row(u, o, check, inplace)
        elif u.shape[0] == 1:
            self._plan.apply_row(u[0], o[0], check, inplace)
        elif u.shape[0]:
            self._plan.apply_rows(u, o, check, inplace)
        if self._floor is not None and o.size and (
                min(o.ravel().tolist()) if o.size <= 32 else o.min()) <= 0:
            lift_zeros(o, self._floor[0], self._floor[1], out=o)  # rare: an output with a 0
        return o

    __call__ = apply

    # ------------------------------------------------------------------ versions
    def with_version(self, version: int, created_at: str | None = None) -> BinMap:
        return dataclasses.replace(self, version=_check_version(version),
                                   created_at=created_at or utc_now())

    # ------------------------------------------------------------------ JSON
    def _content(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "model_id": self.model_id,
            "version": _check_version(self.version),
            "created_at": self.created_at,
            "eps": float(self.eps),
            "p": "inf" if math.isinf(self.p) else float(self.p),
            "delta": float(self.delta),
            "beta": float(self.beta),
            "lam": int(self.lam),
            "k": int(self.k),
            "temperature": None if self.temperature is None else float(self.temperature),
            "outside": self.outside,
            "sizing": self.sizing,
            "iterations": int(self.iterations),
            "stop_reason": self.stop_reason,
            "est_error": self.est_error,
            "n_bins": self.n_bins,
            "n_groups": self.n_groups,
            "bins": list(self.bins),
            "group": self.group.tolist(),
            "preds": [_encode_pred(r) for r in self.preds],
            "mode": self.mode,
            "certificate": self._certificate_doc(),
        } | ({} if self.floor is None else {"floor": self.floor})

    def _certificate_doc(self) -> dict | None:
        """The JSON form of :attr:`certificate`: for a map loaded from an artifact, the
        certificate object exactly as it was read (so ``to_json`` writes back the same bytes,
        even for certificates written before some of their fields existed); else
        :meth:`~lpcal.certificate.Certificate.to_dict`."""
        if self.certificate is None:
            return None
        loaded = self.__dict__.get("_loaded_certificate")
        return loaded if loaded is not None else self.certificate.to_dict()

    @staticmethod
    def _digest(content: dict) -> str:
        from lpcal.signing import canonical  # lazily: ``import lpcal`` loads no cryptography

        return "sha256:" + hashlib.sha256(canonical(content)).hexdigest()

    def to_json(self, *, signer: Any = None) -> bytes:
        """The artifact; with ``signer`` (an :class:`lpcal.signing.Signer`) a signed one."""
        from lpcal.signing import canonical

        content = self._content()
        if signer is not None:
            content["signature"] = signer.sign(canonical(content))
        content["checksum"] = self._digest(content)
        return canonical(content)

    @property
    def checksum(self) -> str:
        """The ``checksum`` of the artifact this map was loaded from, else of its unsigned
        content (what ``to_json()`` writes)."""
        loaded = self.__dict__.get("_artifact_checksum")
        return loaded if loaded is not None else self._digest(self._content())

    @property
    def verified_by(self) -> str | None:
        """Key id whose signature was verified when this map was loaded (``from_json`` with
        ``public_keys``), else None."""
        return self.__dict__.get("_verified_by")

    @property
    def signature_key_id(self) -> str | None:
        """Key id named by the signature of the artifact this map was loaded from (None if it
        was unsigned or not loaded); verified only if :attr:`verified_by` is set too."""
        return self.__dict__.get("_signature_key_id")

    @classmethod
    def from_json(cls, data: bytes | str, *, where: str = "bin map",
                  public_keys: Any = None) -> BinMap:
        """Load and verify an artifact; raises :class:`ArtifactError` saying what is wrong.

        ``public_keys`` (a :class:`lpcal.signing.KeyRing` or anything it takes: PEM, raw or
        base64 keys, key files): require a valid signature by one of them, else
        :class:`lpcal.signing.SignatureError`. Without keys (None or empty) a signature is not
        checked and unsigned maps load (development)."""
        if isinstance(data, str):
            data = data.encode()
        if not data:
            raise ArtifactError(f"{where}: empty artifact")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ArtifactError(f"{where}: not valid JSON, truncated or corrupt ({e})") from None
        if not isinstance(obj, dict):
            raise ArtifactError(f"{where}: top level must be a JSON object")
        schema = obj.get("schema")
        if schema not in READABLE_SCHEMAS or isinstance(schema, bool):
            raise ArtifactError(f"{where}: incompatible schema {schema!r}; this lpcal reads "
                                f"schemas {', '.join(map(str, READABLE_SCHEMAS))}")
        checksum = obj.pop("checksum", None)
        if not isinstance(checksum, str):
            raise ArtifactError(f"{where}: missing checksum")
        if cls._digest(obj) != checksum:
            raise ArtifactError(f"{where}: checksum mismatch (artifact corrupt or tampered)")
        signature = obj.pop("signature", None)
        from lpcal.signing import KeyRing, canonical

        ring = KeyRing.of(public_keys)
        verified_by = None if ring is None else ring.verify(canonical(obj), signature, where)
        version = _check_version(obj.get("version"), where)
        try:
            p = math.inf if obj["p"] == "inf" else float(obj["p"])
            k = int(obj["k"])
            cert_doc = None if schema < 2 or obj["certificate"] is None else dict(
                obj["certificate"])
            preds = np.array([_decode_pred(o, k, g) for g, o in enumerate(obj["preds"])]
                             ).reshape(-1, k)
            bm = cls(
                model_id=str(obj["model_id"]), version=version,
                created_at=str(obj["created_at"]), eps=float(obj["eps"]), p=p,
                delta=float(obj["delta"]), beta=float(obj["beta"]), lam=int(obj["lam"]), k=k,
                temperature=None if obj["temperature"] is None else float(obj["temperature"]),
                outside=str(obj["outside"]), sizing=dict(obj["sizing"]),
                iterations=int(obj["iterations"]), stop_reason=str(obj["stop_reason"]),
                est_error=dict(obj["est_error"]), bins=tuple(obj["bins"]),
                group=np.asarray(obj["group"], dtype=np.int64), preds=preds,
                mode=str(obj["mode"]) if schema >= 2 else "paper",
                certificate=None if cert_doc is None else Certificate.from_dict(cert_doc),
                floor=None if obj.get("floor") is None else dict(obj["floor"]),
            )
        except KeyError as e:
            raise ArtifactError(f"{where}: missing field {e}") from None
        except InputError as e:
            raise ArtifactError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{where}: malformed field ({e})") from None
        if bm.n_bins != obj.get("n_bins") or bm.n_groups != obj.get("n_groups"):
            raise ArtifactError(f"{where}: n_bins/n_groups disagree with the stored bins")
        object.__setattr__(bm, "_artifact_checksum", checksum)
        object.__setattr__(bm, "_loaded_certificate", cert_doc)
        object.__setattr__(bm, "_verified_by", verified_by)
        object.__setattr__(bm, "_signature_key_id", None if not isinstance(signature, dict)
                           else str(signature.get("key_id")))
        return bm

    def summary(self) -> dict:
        return {
            "model_id": self.model_id, "version": self.version, "created_at": self.created_at,
            "eps": self.eps, "p": "inf" if math.isinf(self.p) else self.p, "beta": self.beta,
            "lambda": self.lam, "k": self.k, "|B|": self.n_bins, "|G|": self.n_groups,
            "iterations": self.iterations, "stop_reason": self.stop_reason,
            "temperature": self.temperature, "outside": self.outside,
            "est_error": self.est_error, "sizing_mode": self.sizing.get("mode"),
            "mode": self.mode, "certificate": self._certificate_doc(), "floor": self.floor,
        }


def _enum_value(enum: type[Mode | Outside], name: str, value: Any) -> str:
    """``value`` as the plain string of a member of ``enum``, else :class:`ArtifactError`."""
    try:
        return enum(value).value
    except ValueError:
        allowed = ", ".join(repr(e.value) for e in enum)
        raise ArtifactError(f"{name} must be one of {allowed}, got {value!r}") from None


def _floor_mask(floor: Any, k: int) -> tuple[np.ndarray, float] | None:
    """``(class mask, eta)`` of a map's ``floor`` field, checked; None without one."""
    if floor is None:
        return None
    try:
        eta = float(floor["eta"])
        classes = np.asarray(floor["classes"], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"floor is malformed ({e})") from None
    mask = np.zeros(k, dtype=bool)
    if classes.ndim != 1 or (classes.size and (classes.min() < 0 or classes.max() >= k)):
        raise ArtifactError(f"floor: classes must be indices in [0, {k})")
    mask[classes] = True
    if not (math.isfinite(eta) and 0.0 <= eta * mask.sum() < 1.0):
        raise ArtifactError(f"floor: eta = {eta} does not fit {int(mask.sum())} classes")
    return mask, eta


def _out_buffer(u: np.ndarray, out) -> tuple[np.ndarray, bool]:
    """Check a caller's ``out`` for ``apply``; ``(out, True)`` when it is ``u`` itself."""
    if not (isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == u.shape
            and out.flags.writeable):
        got = (f"{out.dtype} array of shape {out.shape}" + ("" if out.flags.writeable else
                                                             ", read-only")
               if isinstance(out, np.ndarray) else type(out).__name__)
        raise InputError(f"out must be a writeable float64 array of shape {u.shape}, got {got}")
    if not np.may_share_memory(out, u):
        return out, False
    if out.ctypes.data == u.ctypes.data and out.strides == u.strides:
        return out, True
    raise InputError("out overlaps probs without being the same array")


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
