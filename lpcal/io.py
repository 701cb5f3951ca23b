"""Loading, validating and saving predictions: probability rows ``probs`` (n, k) and labels (n,).

Formats
-------
* ``.npz``: arrays ``probs`` (n, k) and ``labels`` (n,). The CIFAR-record names ``predictions`` /
  ``ground_truth`` are accepted too (``probs`` wins when both are present). With ``logits=True`` an
  array named ``logits`` is preferred, and whatever array is found is treated as logits.
* ``.csv``: a header ``p0,p1,...,p{k-1},label`` (any column order; ``label`` optional when
  ``require_labels=False``) and one sample per line.

With ``logits=True`` the loaded rows are mapped through a numerically stable softmax
``softmax(z)_j = exp(z_j - max z) / sum_i exp(z_i - max z)`` before validation.

Validation (:func:`validate_probs`, :func:`validate_labels`) raises :class:`lpcal.errors.InputError`
with a message naming the file (or the caller's ``where``), the first offending row (for CSV: the
line number in the file) and the problem: wrong shape, NaN/inf, a negative entry, a row whose sum
differs from 1 by more than ``tol`` (the sum is reported), a label that is not an integer or lies
outside ``[0, k)``, a class-count mismatch against ``expected_k``, empty input, missing columns.
"""

from __future__ import annotations

import csv
import os
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lpcal.errors import InputError

DEFAULT_TOL = 1e-4
"""Default tolerance on ``|sum(row) - 1|``; float32 softmax outputs sit well inside it."""

_PROB_KEYS = ("probs", "predictions")
_LOGIT_KEYS = ("logits", "probs", "predictions")
_LABEL_KEYS = ("labels", "ground_truth")
_PCOL = re.compile(r"^p(\d+)$")

RowName = Callable[[int], str]


def _row_name(row_name: RowName | None, i: int) -> str:
    return row_name(i) if row_name is not None else f"row {i}"


def _first_bad(mask: np.ndarray, where: str, row_name: RowName | None, problem) -> None:
    """Raise for the first True entry of a per-row ``mask``; ``problem(i)`` describes row ``i``."""
    bad = np.flatnonzero(mask)
    if bad.size:
        i = int(bad[0])
        more = f" (and {bad.size - 1} more rows)" if bad.size > 1 else ""
        raise InputError(f"{where}: {_row_name(row_name, i)}{more}: {problem(i)}")


# ----------------------------------------------------------------------------- validation


def _num(v) -> str:
    """An integral float as an int when exactly representable (2.0 -> '2'), else its repr."""
    f = float(v)
    return str(int(f)) if abs(f) < 2.0**53 else repr(f)


def validate_probs(
    probs,
    where: str = "probs",
    *,
    tol: float = DEFAULT_TOL,
    expected_k: int | None = None,
    row_name: RowName | None = None,
) -> np.ndarray:
    """Check that ``probs`` is an (n, k) array of probability vectors; return it as float64.

    Every entry must be finite and ``>= 0`` and every row must satisfy ``|sum(row) - 1| <= tol``.
    ``where`` prefixes every error message (e.g. a file name); ``row_name(i)`` renders row ``i``
    (default ``"row i"``; the CSV loader passes ``"line N"``). Rows are not renormalised.
    """
    try:
        x = np.asarray(probs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: probabilities are not a numeric array ({exc})") from None
    if x.ndim != 2:
        raise InputError(f"{where}: expected a 2-D array of shape (n, k), got shape {x.shape}")
    n, k = x.shape
    if n == 0:
        raise InputError(f"{where}: empty input (0 rows)")
    if k == 0:
        raise InputError(f"{where}: rows have 0 classes")
    if expected_k is not None and k != expected_k:
        raise InputError(f"{where}: expected {expected_k} classes, got {k}")
    finite = np.isfinite(x)
    if not finite.all():
        row_bad = ~finite.all(axis=1)

        def _nonfinite(i: int) -> str:
            j = int(np.flatnonzero(~finite[i])[0])
            return f"probability of class {j} is {float(x[i, j])!r} (NaN/inf not allowed)"

        _first_bad(row_bad, where, row_name, _nonfinite)
    neg = x < 0
    if neg.any():

        def _negative(i: int) -> str:
            j = int(np.flatnonzero(neg[i])[0])
            return f"probability of class {j} is negative ({x[i, j]:.6g})"

        _first_bad(neg.any(axis=1), where, row_name, _negative)
    s = x.sum(axis=1)
    off = np.abs(s - 1.0) > tol
    if off.any():
        _first_bad(
            off,
            where,
            row_name,
            lambda i: f"probabilities sum to {s[i]:.8g}, not 1 (tolerance {tol:g})",
        )
    return x


def validate_labels(
    labels,
    k: int,
    where: str = "labels",
    *,
    n: int | None = None,
    row_name: RowName | None = None,
) -> np.ndarray:
    """Check that ``labels`` is a 1-D array of integers in ``[0, k)``; return it as int64.

    Float arrays are accepted when every value is integral (CSV columns parse as floats).
    ``n`` (if given) is the expected length, i.e. the number of probability rows.
    """
    y = np.asarray(labels)
    if y.ndim != 1:
        raise InputError(f"{where}: expected a 1-D array of labels, got shape {y.shape}")
    if y.size == 0:
        raise InputError(f"{where}: empty input (0 labels)")
    if n is not None and y.shape[0] != n:
        raise InputError(f"{where}: {y.shape[0]} labels for {n} probability rows")
    if y.dtype == np.bool_ or not (
        np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
    ):
        raise InputError(f"{where}: labels must be integers, got dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating):
        yf = y.astype(np.float64)
        finite = np.isfinite(yf)
        nonint = ~finite | (yf != np.floor(np.where(finite, yf, 0.0)))
        _first_bad(nonint, where, row_name, lambda i: f"label {float(yf[i])!r} is not an integer")
        out = (yf < 0) | (yf >= k)  # checked before the cast, which would overflow for 1e300
        _first_bad(out, where, row_name, lambda i: f"label {_num(yf[i])} outside [0, {k})")
        return yf.astype(np.int64)
    out = (y < 0) | (y >= k)
    _first_bad(out, where, row_name, lambda i: f"label {int(y[i])} outside [0, {k})")
    return y.astype(np.int64)


def softmax_rows(z: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Row-wise softmax ``exp(z - max z) / sum exp(z - max z)`` of a 2-D array, unchecked.

    The one softmax of lpcal and the daemon: stable (the shift by the row maximum keeps ``exp``
    from overflowing), vectorised, three passes over the rows. It does not validate: a row
    holding NaN or inf gives NaN; :func:`softmax` is the checked form for untrusted input.

    Parameters
    ----------
    z : numpy.ndarray, shape (n, k)
        Logits (any float dtype is kept; integers become float64).
    out : numpy.ndarray, optional
        Where to write the result, of ``z``'s shape; ``out=z`` computes in place. Default: a
        new array.

    Returns
    -------
    numpy.ndarray
        ``out``, or the new array.

    Examples
    --------
    >>> import numpy as np
    >>> from lpcal.io import softmax_rows
    >>> softmax_rows(np.array([[0.0, 0.0], [1000.0, 0.0]])).round(3).tolist()
    [[0.5, 0.5], [1.0, 0.0]]
    """
    z = np.asarray(z)
    if not np.issubdtype(z.dtype, np.floating):
        z = z.astype(np.float64)
    out = np.subtract(z, z.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=1, keepdims=True)
    return out


def softmax(logits, where: str = "logits", *, row_name: RowName | None = None) -> np.ndarray:
    """Row-wise softmax ``exp(z - max z) / sum exp(z - max z)`` (stable; never overflows) of
    logits checked first: a 2-D, non-empty, finite array, else :class:`InputError` naming
    ``where`` and the first bad row. Computed by :func:`softmax_rows`."""
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2:
        raise InputError(f"{where}: expected a 2-D array of shape (n, k), got shape {z.shape}")
    if z.shape[0] == 0 or z.shape[1] == 0:
        raise InputError(f"{where}: empty input, shape {z.shape}")
    finite = np.isfinite(z)
    if not finite.all():

        def _nonfinite(i: int) -> str:
            j = int(np.flatnonzero(~finite[i])[0])
            return f"logit of class {j} is {float(z[i, j])!r} (NaN/inf not allowed)"

        _first_bad(~finite.all(axis=1), where, row_name, _nonfinite)
    return softmax_rows(z)


# ----------------------------------------------------------------------------- loading


def load_predictions(
    path: str | os.PathLike,
    *,
    logits: bool = False,
    expected_k: int | None = None,
    tol: float = DEFAULT_TOL,
    require_labels: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Load ``(probs, labels)`` from a ``.npz`` or ``.csv`` file (see the module docstring).

    Returns float64 probabilities (n, k) and int64 labels (n,), or ``None`` for the labels when
    the file has none and ``require_labels=False``. Raises :class:`InputError` naming the file.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".npz", ".csv"):
        raise InputError(
            f"{p}: unsupported file type {suffix or '(none)'!r}, expected .npz or .csv"
        )
    if not p.is_file():
        raise InputError(f"{p}: no such file")
    if suffix == ".npz":
        raw, labels, row_name = _read_npz(p, logits, require_labels)
    else:
        raw, labels, row_name = _read_csv(p, require_labels)
    where = str(p)
    if logits:
        probs = softmax(raw, where, row_name=row_name)
    else:
        probs = raw
    probs = validate_probs(probs, where, tol=tol, expected_k=expected_k, row_name=row_name)
    if labels is not None:
        labels = validate_labels(labels, probs.shape[1], where, n=probs.shape[0], row_name=row_name)
    return probs, labels


def _read_npz(p: Path, logits: bool, require_labels: bool):
    try:
        with np.load(p, allow_pickle=False) as z:
            keys = list(z.files)
            pkeys = _LOGIT_KEYS if logits else _PROB_KEYS
            pk = next((key for key in pkeys if key in keys), None)
            if pk is None:
                want = " or ".join(repr(key) for key in pkeys)
                raise InputError(f"{p}: no array named {want}; found {keys}")
            lk = next((key for key in _LABEL_KEYS if key in keys), None)
            if lk is None and require_labels:
                want = " or ".join(repr(key) for key in _LABEL_KEYS)
                raise InputError(f"{p}: no labels array named {want}; found {keys}")
            raw = z[pk]
            labels = z[lk] if lk is not None else None
    except InputError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise InputError(f"{p}: not a readable .npz archive ({exc})") from None
    return raw, labels, None


def _read_csv(p: Path, require_labels: bool):
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read as UTF-8 text ({exc})") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise InputError(f"{p}: empty file, expected a header 'p0,...,p{{k-1}},label'")
    header = [h.strip() for h in next(csv.reader([lines[0]]))]
    pcols: dict[int, int] = {}
    label_col = None
    for pos, name in enumerate(header):
        m = _PCOL.match(name)
        if m:
            j = int(m.group(1))
            if j in pcols:
                raise InputError(f"{p}: line 1: duplicate column {name!r}")
            pcols[j] = pos
        elif name == "label":
            if label_col is not None:
                raise InputError(f"{p}: line 1: duplicate column 'label'")
            label_col = pos
        else:
            raise InputError(
                f"{p}: line 1: unexpected column {name!r} (expected p0..p{{k-1}} and label)"
            )
    if not pcols:
        raise InputError(f"{p}: line 1: no probability columns p0..p{{k-1}} in header {header}")
    k = max(pcols) + 1
    missing = [f"p{j}" for j in range(k) if j not in pcols]
    if missing:
        raise InputError(f"{p}: line 1: missing column(s) {', '.join(missing)}")
    if label_col is None and require_labels:
        raise InputError(f"{p}: line 1: missing column 'label'")
    body = lines[1:]
    if not body:
        raise InputError(f"{p}: empty input (header but no data rows)")
    blank = [i for i, line in enumerate(body) if not line.strip()]
    if blank:
        raise InputError(f"{p}: line {blank[0] + 2}: empty line")
    try:
        data = np.loadtxt(body, delimiter=",", dtype=np.float64, ndmin=2, comments=None)
    except ValueError as exc:
        _locate_csv_error(p, body, header)
        raise InputError(f"{p}: cannot parse CSV ({exc})") from None
    if data.shape[1] != len(header):
        _locate_csv_error(p, body, header)
        raise InputError(f"{p}: expected {len(header)} fields per line, got {data.shape[1]}")
    probs = data[:, [pcols[j] for j in range(k)]]
    labels = data[:, label_col] if label_col is not None else None
    return probs, labels, (lambda i: f"line {i + 2}")


def _locate_csv_error(p: Path, body: list[str], header: list[str]) -> None:
    """Slow path, only after a parse failure: find and report the first malformed line."""
    for i, fields in enumerate(csv.reader(body)):
        line = i + 2
        if len(fields) != len(header):
            raise InputError(f"{p}: line {line}: expected {len(header)} fields, got {len(fields)}")
        for name, value in zip(header, fields):
            try:
                float(value)
            except ValueError:
                raise InputError(
                    f"{p}: line {line}, column {name!r}: cannot parse {value.strip()!r} as a number"
                ) from None


# ----------------------------------------------------------------------------- saving


def _file_mode() -> int:
    """The mode ``open()`` gives a new file: ``0o666`` less the process umask (read without
    changing it for good: set and restored at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def check_output_path(path: str | os.PathLike) -> Path:
    """``path`` as a :class:`~pathlib.Path` if a file can be written there: not a directory, in
    an existing directory (checked before a long computation whose result goes there); else
    :class:`InputError` naming it."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise InputError(f"{p}: directory {str(p.parent)!r} does not exist (create it first)")
    return p


def write_output(path: str | os.PathLike, write: Callable | bytes) -> Path:
    """Write an output file atomically; the one writer of every file lpcal's CLI produces.

    ``write`` is the content (``bytes``) or a function that writes to a binary file object. The
    content goes to a temporary file in the target's directory, which is then renamed over
    ``path``, so readers never see a partial file. The file gets the mode of a file made by
    ``open()`` (``0o666`` less the umask: ``0644`` under the usual ``022``). No directory is
    created.

    Raises
    ------
    InputError
        One line naming ``path`` and the problem: its directory does not exist, ``path`` is a
        directory, or the system refused to write (permission, read-only or special file system,
        disk full). No temporary file is left behind.
    """
    p = check_output_path(path)
    parent = p.parent
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{p.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            if isinstance(write, bytes | bytearray | memoryview):
                fh.write(write)
            else:
                write(fh)
            os.fchmod(fh.fileno(), _file_mode())
        os.replace(tmp, p)
    except OSError as e:
        _discard(tmp)
        raise InputError(f"{p}: cannot write ({e.strerror or e})") from None
    except BaseException:
        _discard(tmp)
        raise
    return p


def _discard(tmp: str | None) -> None:
    if tmp is not None:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def save_npz(path: str | os.PathLike, probs, labels=None, *, tol: float = DEFAULT_TOL) -> Path:
    """Validate and write ``probs`` (and ``labels`` if given) to a compressed ``.npz``, atomically.

    Written by :func:`write_output` (no directory is created; errors name the path). The arrays are stored under the keys ``probs`` (float64) and ``labels`` (int64), which
    :func:`load_predictions` reads back. Returns the path written (exactly ``path``).
    """
    p = Path(path)
    x = validate_probs(probs, str(p), tol=tol)
    arrays = {"probs": x}
    if labels is not None:
        arrays["labels"] = validate_labels(labels, x.shape[1], str(p), n=x.shape[0])
    return write_output(p, lambda fh: np.savez_compressed(fh, **arrays))


def save_csv(path: str | os.PathLike, probs, labels=None, *, tol: float = DEFAULT_TOL) -> Path:
    """Validate and write a CSV with header ``p0..p{k-1}[,label]`` (17 significant digits)."""
    p = Path(path)
    x = validate_probs(probs, str(p), tol=tol)
    k = x.shape[1]
    cols = [f"p{j}" for j in range(k)]
    fmt = ["%.17g"] * k
    data = x
    if labels is not None:
        y = validate_labels(labels, k, str(p), n=x.shape[0])
        cols.append("label")
        fmt.append("%d")
        data = np.column_stack([x, y.astype(np.float64)])
    return write_output(
        p,
        lambda fh: np.savetxt(fh, data, delimiter=",", fmt=fmt, header=",".join(cols), comments=""),
    )
