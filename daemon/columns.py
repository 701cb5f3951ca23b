"""The fields of a batch of well-formed events as columns: the first step of the parser's fast path.

:func:`columns` takes the dicts that ``orjson.loads`` made of a batch and returns their fields
as columns when *every* event has the common shape: a JSON object with a str ``model`` of
1..``max_model_len`` characters and a str ``id`` of 1..``max_id_len``, an int or float ``ts``, no
``logits``, and a list ``probs`` of ints/floats and/or a non-negative int ``label``. Otherwise it
returns None and :class:`daemon.events.EventParser` runs its general per-message loop, which
judges each event on its own. Types are exact: a bool is not an int here.

Two implementations with one result, reached through ``daemon.native.KERNELS.scan``: the C
kernel (one pass over the dicts) and :func:`scan_python` / :func:`columns_python`, the
reference, built from C-level ``map`` passes. ``tests/daemon/test_native.py`` holds them equal on random and adversarial batches.
Both leave to the general path what NumPy's conversion would treat specially: vector entries
that are ints beyond 2**53, and labels beyond int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import is_not

import numpy as np

__all__ = ["Columns", "columns_python", "native_columns",
           "scan_python"]

_EXACT = 2.0**53


@dataclass(slots=True)
class Columns:
    """One batch's fields. ``labels[i] = -1`` and ``has_vec[i] = False`` mark absent fields.

    The vectors stay in their source form until :meth:`matrix` asks for one model's rows: a list
    of Python lists (``vecs``), or the native kernel's concatenated entries (``flat``, with the
    length ``vlen[i]`` and start ``start[i]`` of event ``i``'s vector)."""

    models: list[str]
    ids: list[str]
    ts: np.ndarray          # float64
    labels: np.ndarray      # int64
    has_vec: np.ndarray     # bool
    vecs: list | None = None
    flat: np.ndarray | None = None
    vlen: np.ndarray | None = None
    start: np.ndarray | None = None

    def matrix(self, rows: np.ndarray, k: int) -> np.ndarray | None:
        """float64 ``(len(rows), k)``: the vectors of the events ``rows`` (all have one), or
        None unless each has exactly ``k`` entries."""
        if rows.size == 0:
            return np.empty((0, k), dtype=np.float64)
        if self.vecs is not None:
            return _numeric_matrix([self.vecs[i] for i in rows.tolist()], k)
        if (self.vlen[rows] != k).any():
            return None
        if rows.size * k == self.flat.size:   # every vector of the batch: already in order
            return self.flat.reshape(rows.size, k)
        return self.flat[self.start[rows][:, None] + np.arange(k)]




def scan_python(items: list, max_model_len: int, max_id_len: int, loads=None,
                max_bytes: int | None = None) -> Columns | None:
    """Reference of the kernel ``scan`` (``daemon.native.KERNELS.scan``): :func:`columns_python`
    of the dicts ``items``, or, with ``loads``, of the message values ``items`` parsed by it
    (None unless every value is bytes of at most ``max_bytes`` bytes that parses)."""
    if loads is not None:
        if set(map(type, items)) != {bytes} or max(map(len, items)) > max_bytes:
            return None
        try:
            items = list(map(loads, items))
        except ValueError:  # orjson.JSONDecodeError
            return None
    return columns_python(items, max_model_len, max_id_len)


def native_columns(cols: tuple | None) -> Columns | None:
    """:class:`Columns` of the C kernel ``scan``'s result (byte buffers read as arrays)."""
    if cols is None:
        return None
    models, ids, ts, labels, vlen, flat = cols
    vl = np.frombuffer(vlen, dtype=np.int64)
    has_vec = vl >= 0
    lengths = np.where(has_vec, vl, 0)
    start = np.cumsum(lengths) - lengths
    return Columns(models, ids, np.frombuffer(ts, dtype=np.float64),
                   np.frombuffer(labels, dtype=np.int64), has_vec,
                   flat=np.frombuffer(flat, dtype=np.float64), vlen=vl, start=start)


def columns_python(ds: list, max_model_len: int, max_id_len: int) -> Columns | None:
    """Reference implementation of :func:`columns` (no native code)."""
    n = len(ds)
    if n == 0 or set(map(type, ds)) != {dict}:
        return None
    get = dict.get
    models = list(map(get, ds, repeat("model")))
    ids = list(map(get, ds, repeat("id")))
    tss = list(map(get, ds, repeat("ts")))
    if (set(map(type, models)) != {str} or set(map(type, ids)) != {str}
            or not set(map(type, tss)) <= {float, int}):
        return None
    if (min(map(len, models)) < 1 or max(map(len, models)) > max_model_len
            or min(map(len, ids)) < 1 or max(map(len, ids)) > max_id_len):
        return None
    if list(map(get, ds, repeat("logits"))).count(None) != n:
        return None
    vecs = list(map(get, ds, repeat("probs")))
    labs = list(map(get, ds, repeat("label")))
    has_vec, has_lab = _present(vecs), _present(labs)
    if not (has_vec | has_lab).all():
        return None
    vlist = [v for v in vecs if v is not None]
    llist = [y for y in labs if y is not None]
    if vlist and set(map(type, vlist)) != {list}:
        return None
    if llist and (set(map(type, llist)) != {int} or min(llist) < 0):
        return None
    try:
        labels = np.full(n, -1, dtype=np.int64)
        labels[has_lab] = llist
        ts = np.array(tss, dtype=np.float64)
    except OverflowError:
        return None
    return Columns(models, ids, ts, labels, has_vec, vecs=vecs)


def _present(values: list) -> np.ndarray:
    """``values[i] is not None`` as a bool array (cheap for all-None / no-None lists)."""
    n = len(values)
    missing = values.count(None)
    if missing == 0:
        return np.ones(n, dtype=bool)
    if missing == n:
        return np.zeros(n, dtype=bool)
    return np.fromiter(map(is_not, values, repeat(None)), dtype=bool, count=n)


def _numeric_matrix(vecs: list[list], k: int) -> np.ndarray | None:
    """``vecs`` (lists) as a float64 ``(len(vecs), k)`` matrix if every entry is an int or a
    float with ``|int| <= 2**53``, else None.

    One ``np.array`` call both converts and type-checks: its dtype is numeric only if every
    entry is a number (strings, None, lists or dicts give another dtype or a ValueError),
    except that bools silently become 0/1. So only the rows holding a 0 or a 1 get the exact
    per-entry type check (none, for typical probability vectors); ints are checked against
    2**53 only when the matrix came out integral or the batch holds an int."""
    try:
        a = np.array(vecs)
    except (ValueError, TypeError, OverflowError):
        return None
    if a.dtype.kind not in "fiu" or a.shape != (len(vecs), k):
        return None
    maybe_bool = np.flatnonzero(((a == 0) | (a == 1)).any(axis=1))
    if maybe_bool.size:
        rows = vecs if maybe_bool.size == len(vecs) else [vecs[r] for r in maybe_bool.tolist()]
        if not {type(x) for v in rows for x in v} <= {float, int}:
            return None
    if a.dtype.kind in "iu":
        if a.size and (np.abs(a.astype(np.float64)) > _EXACT).any():
            return None
    elif (np.abs(a) >= _EXACT).any() and _big_int(vecs):  # an int > 2**53 may round to 2**53
        return None
    return a.astype(np.float64, copy=False)


def _big_int(vecs: list[list]) -> bool:
    """Whether an entry is an int with ``|x| > 2**53`` (rare: only asked for huge entries)."""
    return any(type(x) is int and abs(x) > _EXACT for v in vecs for x in v)
