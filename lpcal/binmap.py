"""The bin map: an immutable, versioned, checksummed artifact mapping raw predictions to calibrated.

``h(x) = pred(S)`` for the group ``S in G`` holding ``R(f(x))`` when ``R(f(x)) in B``; otherwise the
fallback ``rho(R(f(x)))`` (the paper) or ``f(x)`` itself (``outside="identity"``). If the bin map
carries a pre-scaling temperature ``T``, ``f`` is first replaced by ``softmax(log f / T)``.

JSON layout (schema 1; orjson; UTF-8)::

    {"schema": 1, "model_id", "version", "created_at", "eps", "p" ("inf" for infinity), "delta",
     "beta", "lam", "k", "temperature" (null if none), "outside", "sizing", "iterations",
     "stop_reason", "est_error", "n_bins", "n_groups",
     "bins": [canonical sparse keys of B], "group": [group of each bin],
     "preds": [{"d": default, "i": [indices], "v": [values]} per group],
     "checksum": "sha256:<hex>"}

Predictions are stored sparsely: every coordinate equals ``d`` except those listed. The checksum
is the sha256 of the canonical JSON (sorted keys) of every other field, so any corruption,
truncation or tampering is detected on load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson

from lpcal.errors import ArtifactError, InputError
from lpcal.levels import BinIndex, _combine, _rows_per_chunk, _weights, decode_keys, floor_into

SCHEMA_VERSION = 1
_SUM_TOL = 1e-3
_OUTSIDE = ("rho", "identity")


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


def _check_rows(u: np.ndarray, s: np.ndarray, offset: int) -> None:
    bad = ~np.isfinite(s) | (np.abs(s - 1.0) > _SUM_TOL) | (u.min(axis=1) < 0)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise InputError(f"row {offset + r}: not a probability vector (sum {s[r]!r}, "
                         f"min {u[r].min()!r})")


def scale_temperature(probs: np.ndarray, temperature: float) -> np.ndarray:
    """``softmax(log(probs) / T)`` row-wise (zeros stay zero), numerically stable."""
    with np.errstate(divide="ignore"):
        z = np.log(probs) / temperature
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@dataclasses.dataclass(frozen=True, eq=False)
class BinMap:
    """A fitted calibrator ``h`` (see the module docstring). Build with ``lpcal.fit``/``fit_pools``."""

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
    bin_rows: dataclasses.InitVar[np.ndarray | None] = None  # rows of ``bins``, if known

    def __post_init__(self, bin_rows: np.ndarray | None = None):
        if self.outside not in _OUTSIDE:
            raise ArtifactError(f"outside must be one of {_OUTSIDE}, got {self.outside!r}")
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
        object.__setattr__(self, "_bin_pred", P[g] if g.size else np.zeros((0, self.k)))

    # ------------------------------------------------------------------ apply
    @property
    def n_bins(self) -> int:
        return len(self.bins)

    @property
    def n_groups(self) -> int:
        return int(self.preds.shape[0])

    def apply(self, probs: np.ndarray, *, check: bool = True) -> np.ndarray:
        """Calibrated probabilities ``h(x)`` for rows of raw probabilities ``f(x)`` (vectorised).

        ``check`` validates rows (finite, non-negative, summing to 1 within 1e-3) and raises
        :class:`InputError` naming the first bad row. Rows are renormalised when their sums are
        far enough from 1 to move a bin boundary. One cache-resident pass per chunk of rows:
        validate, bin, hash, look up in ``B``, write the group prediction or the fallback.
        """
        u = np.asarray(probs, dtype=np.float64)
        one = u.ndim == 1
        u = np.atleast_2d(u)
        if u.ndim != 2 or u.shape[1] != self.k:
            raise InputError(f"expected probability rows of length {self.k}, got shape {u.shape}")
        if self.temperature is not None:
            s = u.sum(axis=1)
            if check:
                _check_rows(u, s, 0)
            u = scale_temperature(u / s[:, None], self.temperature)
            check = False
        n, k, lam = u.shape[0], self.k, self.lam
        out = np.empty((n, k))
        w = _weights(k)
        step = _rows_per_chunk(k)
        buf = np.empty((min(step, n), k))
        rho = self.outside == "rho"
        inv_lam, inv_klam = 1.0 / lam, 1.0 / (k * lam)
        for a in range(0, n, step):
            b_ = min(a + step, n)
            src = u[a:b_]
            s = src.sum(axis=1)
            if check:
                _check_rows(src, s, a)
            if np.abs(s - 1.0).max() * lam > 1e-6:
                src = src / s[:, None]
            t = floor_into(src, lam, buf[: b_ - a])
            hh = t @ w
            idx = self._index.lookup_hashed(_combine(hh), hh)
            o = out[a:b_]
            if rho:
                np.multiply(t, inv_lam, out=o)
                o += ((lam - t.sum(axis=1)) * inv_klam)[:, None]
            else:
                o[...] = src
            hit = idx >= 0
            if hit.any():
                o[hit] = self._bin_pred[idx[hit]]
        return out[0] if one else out

    __call__ = apply

    # ------------------------------------------------------------------ versions
    def with_version(self, version: int, created_at: str | None = None) -> BinMap:
        return dataclasses.replace(self, version=int(version),
                                   created_at=created_at or utc_now())

    # ------------------------------------------------------------------ JSON
    def _content(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "model_id": self.model_id,
            "version": int(self.version),
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
        }

    @staticmethod
    def _digest(content: dict) -> str:
        canon = orjson.dumps(content, option=orjson.OPT_SORT_KEYS)
        return "sha256:" + hashlib.sha256(canon).hexdigest()

    def to_json(self) -> bytes:
        content = self._content()
        content["checksum"] = self._digest(content)
        return orjson.dumps(content, option=orjson.OPT_SORT_KEYS)

    @property
    def checksum(self) -> str:
        return self._digest(self._content())

    @classmethod
    def from_json(cls, data: bytes | str, *, where: str = "bin map") -> BinMap:
        """Load and verify an artifact; raises :class:`ArtifactError` saying what is wrong."""
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
        if schema != SCHEMA_VERSION:
            raise ArtifactError(f"{where}: incompatible schema {schema!r}; this lpcal reads "
                                f"schema {SCHEMA_VERSION}")
        checksum = obj.pop("checksum", None)
        if not isinstance(checksum, str):
            raise ArtifactError(f"{where}: missing checksum")
        if cls._digest(obj) != checksum:
            raise ArtifactError(f"{where}: checksum mismatch (artifact corrupt or tampered)")
        try:
            p = math.inf if obj["p"] == "inf" else float(obj["p"])
            k = int(obj["k"])
            preds = np.array([_decode_pred(o, k, g) for g, o in enumerate(obj["preds"])]
                             ).reshape(-1, k)
            bm = cls(
                model_id=str(obj["model_id"]), version=int(obj["version"]),
                created_at=str(obj["created_at"]), eps=float(obj["eps"]), p=p,
                delta=float(obj["delta"]), beta=float(obj["beta"]), lam=int(obj["lam"]), k=k,
                temperature=None if obj["temperature"] is None else float(obj["temperature"]),
                outside=str(obj["outside"]), sizing=dict(obj["sizing"]),
                iterations=int(obj["iterations"]), stop_reason=str(obj["stop_reason"]),
                est_error=dict(obj["est_error"]), bins=tuple(obj["bins"]),
                group=np.asarray(obj["group"], dtype=np.int64), preds=preds,
            )
        except KeyError as e:
            raise ArtifactError(f"{where}: missing field {e}") from None
        except InputError as e:
            raise ArtifactError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{where}: malformed field ({e})") from None
        if bm.n_bins != obj.get("n_bins") or bm.n_groups != obj.get("n_groups"):
            raise ArtifactError(f"{where}: n_bins/n_groups disagree with the stored bins")
        return bm

    def summary(self) -> dict:
        return {
            "model_id": self.model_id, "version": self.version, "created_at": self.created_at,
            "eps": self.eps, "p": "inf" if math.isinf(self.p) else self.p, "beta": self.beta,
            "lambda": self.lam, "k": self.k, "|B|": self.n_bins, "|G|": self.n_groups,
            "iterations": self.iterations, "stop_reason": self.stop_reason,
            "temperature": self.temperature, "outside": self.outside,
            "est_error": self.est_error, "sizing_mode": self.sizing.get("mode"),
        }


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
