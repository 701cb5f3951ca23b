"""The kernels behind :meth:`lpcal.binmap.BinMap.apply`: chunked batches and one row at a time.

An :class:`ApplyPlan` is built once per bin map (at load) and holds everything ``apply`` needs
besides the input: the temperature, the bins of ``B`` as a lookup table on the low bits of their
first exact hash and, for single rows, a ``dict`` from a bin's two exact 53-bit hashes to its
group prediction. Both confirm a hit on the two exact hashes, as :class:`lpcal.levels.BinIndex`
does (a false hit needs a collision of both, probability ``2^-66`` per pair of bins).

Temperature
-----------
With a temperature ``T`` a row ``f`` becomes ``g = softmax(log f / T)``, computed as temperature
scaling itself, in place in the output: one ``log``, one multiplication by ``1/T``, one ``exp``,
a row sum and one normalisation. The row sum of ``f`` and the usual shift by the row maximum are
left out: both only add a per-row constant to ``log f / T``, which the softmax ignores. The
shift matters only when ``exp`` underflows or overflows, so a row whose sum of
``exp(log f / T)`` lies outside ``[1e-200, 1e200]`` (or is not finite) is recomputed as before
(:func:`scale_temperature` of the normalised row). Results agree with that reference to rounding
(about 1e-16 absolute). A map that is the temperature alone (``B`` empty, identity outside)
stops there.

Validation (``check=True``)
---------------------------
A row is valid when it is finite, non-negative and sums to 1 within 1e-3. Batches check this
with one row sum (a BLAS ``gemv`` over rows already in cache) and, without a temperature, one
minimum over the chunk; with a temperature, a negative or NaN entry makes ``log`` return NaN and
so shows up in the normalising sum. Only a failing chunk is re-examined row by row, to name the
first bad row. On an error, ``out`` may already hold results for earlier rows.

Chunks
------
Rows are processed in chunks of ``2^16`` values (512 KiB of float64, resident in L2), but never
fewer than :data:`MIN_CHUNK_ROWS` rows, so that very wide rows (``k = 10,000``) do not turn into
thousands of tiny chunks whose per-chunk overhead dominates.
"""

from __future__ import annotations

import numpy as np

from lpcal.errors import InputError, shown
from lpcal.io import softmax_rows
from lpcal.levels import FLOOR_TOL, BinIndex, _combine, _weights, floor_into

SUM_TOL = 1e-3
CHUNK_VALUES = 1 << 16
MIN_CHUNK_ROWS = 16
_E_MIN, _E_MAX = 1e-200, 1e200  # sum(exp(log f / T)) outside: recompute the row, shifted
_CROWDED = -2  # a slot of the lookup table shared by two bins of B
_SHORT = 32  # rows up to this length are summed as Python lists on the single-row path
# log(0), log(<0), exp overflow: handled by the kernels (the decorator form is thread-safe)
_QUIET = np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore")


def chunk_rows(k: int) -> int:
    """Rows per chunk for rows of length ``k``: ``max(16, 2^16 // k)``."""
    return max(MIN_CHUNK_ROWS, CHUNK_VALUES // max(k, 1))


def _slot_table(key: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """``(table, mask, crowded)``: ``table[key_i & mask] = i`` for the bins of B (at most 1/32
    of the slots used: 128 to 256 bytes per bin), ``-1`` for empty slots and ``-2`` for slots
    that two bins share (``crowded``: there is such a slot)."""
    m = key.size
    bits = min(22, max(8, m.bit_length() + 5))
    mask = (1 << bits) - 1
    table = np.full(1 << bits, -1, dtype=np.int32)
    if not m:
        return table, mask, False
    slot = key & mask
    table[slot] = np.arange(m, dtype=np.int32)
    uniq, counts = np.unique(slot, return_counts=True)
    shared = uniq[counts > 1]
    table[shared] = _CROWDED
    return table, mask, bool(shared.size)


def _sums_ok(s: np.ndarray) -> bool:
    """All row sums within 1e-3 of 1 (two reductions; ``False`` when one is NaN)."""
    return bool(s.min() >= 1.0 - SUM_TOL and s.max() <= 1.0 + SUM_TOL)


def check_rows(u: np.ndarray, s: np.ndarray, offset: int) -> None:
    """Raise :class:`InputError` naming the first row of ``u`` (row sums ``s``) that is not a
    probability vector: not finite, a negative entry, or a sum off 1 by more than 1e-3."""
    bad = ~np.isfinite(s) | (np.abs(s - 1.0) > SUM_TOL) | (u.min(axis=1) < 0)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise InputError(f"row {offset + r}: not a probability vector (sum {shown(s[r])}, "
                         f"min {shown(u[r].min())})")


def scale_temperature(probs: np.ndarray, temperature: float, *,
                      log_probs: np.ndarray | None = None) -> np.ndarray:
    """``softmax(log(probs) / T)`` row-wise (zeros stay zero), numerically stable.
    ``log_probs``: ``np.log(probs)`` if the caller has it (not modified)."""
    if log_probs is not None:
        z = log_probs / temperature
    else:
        with np.errstate(divide="ignore"):
            z = np.log(probs) / temperature
    return softmax_rows(z, out=z)


class ApplyPlan:
    """What applying one bin map needs, prepared once (see the module docstring).

    Parameters
    ----------
    k, lam : int
        Classes and the discretisation ``lambda``.
    temperature : float or None
        Pre-scaling temperature.
    rho : bool
        ``True``: ``rho(R(g))`` outside ``B``; ``False``: ``g`` itself.
    index : BinIndex
        The bins of ``B``.
    bin_pred : numpy.ndarray
        ``(|B|, k)`` read-only prediction of every bin of ``B``.
    """

    __slots__ = ("T", "bin_pred", "binned", "crowded", "index", "inv_T", "inv_klam", "inv_lam",
                 "k", "lam", "mask", "ones", "pair", "rho", "row_hits", "slots", "w", "w3")

    def __init__(self, k: int, lam: int, temperature: float | None, rho: bool,
                 index: BinIndex, bin_pred: np.ndarray):
        self.k, self.lam, self.T, self.rho = k, lam, temperature, rho
        self.inv_T = None if temperature is None else 1.0 / temperature
        self.index, self.bin_pred = index, bin_pred
        # temperature scaling alone (B empty, identity outside) needs no bins at all
        self.binned = rho or len(index) > 0
        self.w = _weights(k)
        self.w3 = np.ascontiguousarray(np.hstack([self.w, np.ones((k, 1))]))  # hashes, sum
        self.ones = np.ones(k)
        self.inv_lam, self.inv_klam = 1.0 / lam, 1.0 / (k * lam)
        pair = index._pair  # the two exact hashes of every bin of B, in B's order
        self.pair = pair
        self.row_hits = {pair[i].tobytes(): bin_pred[i] for i in range(len(index))}
        self.slots, self.mask, self.crowded = _slot_table(pair[:, 0].astype(np.int64))
        for arr in (self.w3, self.ones, self.slots):  # shared by every thread: never written
            arr.setflags(write=False)

    # ------------------------------------------------------------------ batches
    @_QUIET
    def apply_rows(self, u: np.ndarray, out: np.ndarray, check: bool, inplace: bool) -> None:
        """Write ``h(u)`` for the ``(n, k)`` rows ``u`` into ``out`` (``inplace``: same array).

        Per chunk, the first pass over the rows is a compute-bound one (``log``, or the floor of
        ``lambda u``) and the validation's row sum comes after it, on rows then in cache.
        """
        n, k = u.shape
        step = chunk_rows(k)
        m = min(step, n)
        s_buf, e_buf = np.empty(m), np.empty(m)
        t_buf = np.empty((m, k)) if self.binned else None
        keep = np.empty((m, k)) if inplace and self.T is not None else None
        clip = not (check or self.T is not None)  # else g is in [0, 1]: clipping is a no-op
        for a in range(0, n, step):
            b = min(a + step, n)
            src, o, s = u[a:b], out[a:b], s_buf[: b - a]
            t = None if t_buf is None else t_buf[: b - a]
            if self.T is not None:
                if keep is not None:  # out is u: keep the rows (error messages, recomputation)
                    src = keep[: b - a]
                    np.copyto(src, u[a:b])
                self._temperature(src, o, check, a, s, e_buf[: b - a])
                if self.binned:
                    self._bin(o, o, self._floor(o, t, False), False)
                continue
            self._floor(src, t, clip)
            np.matmul(src, self.ones, out=s)
            if check and not (src.min() >= 0 and _sums_ok(s)):
                check_rows(src, s, a)
            g = src
            if max(1.0 - s.min(), s.max() - 1.0) * self.lam > 1e-6:  # may move a bin boundary
                g = src / s[:, None]
                self._floor(g, t, clip)
            self._bin(g, o, t, copy_g=not (inplace and g is src))

    def _temperature(self, src, o, check, offset, s, e) -> None:
        """``o = exp(log(src) / T)`` normalised (module docstring), validating ``src``."""
        np.log(src, out=o)
        if check:
            np.matmul(src, self.ones, out=s)
            if not _sums_ok(s):
                check_rows(src, s, offset)
        np.multiply(o, self.inv_T, out=o)
        np.exp(o, out=o)
        np.matmul(o, self.ones, out=e)
        if not (e.min() >= _E_MIN and e.max() <= _E_MAX):  # False for NaN too
            bad = np.flatnonzero(~((e >= _E_MIN) & (e <= _E_MAX)))
            if check:  # a negative entry (log -> NaN): name the row
                check_rows(src, s, offset)
            sb = src[bad].sum(axis=1, keepdims=True)
            o[bad] = scale_temperature(src[bad] / sb, self.T)
            e[bad] = 1.0
        np.reciprocal(e, out=e)
        np.multiply(o, e[:, None], out=o)

    def _floor(self, g, t, clip: bool) -> np.ndarray:
        """``lambda R(g)`` into ``t``; ``clip=False`` when ``g`` is known to lie in [0, 1]."""
        if clip:
            return floor_into(g, self.lam, t)
        np.multiply(g, self.lam, out=t)
        t += FLOOR_TOL
        return np.floor(t, out=t)

    def _bin(self, g, o, t, copy_g: bool) -> None:
        """Write the fallback (``rho(t / lambda)`` or ``g``) and the predictions of rows in B."""
        h3 = t @ self.w3  # the two exact hashes and the row sum of every bin, in one gemm
        if self.rho:
            np.multiply(t, self.inv_lam, out=o)
            o += ((self.lam - h3[:, 2]) * self.inv_klam)[:, None]
        elif copy_g:
            o[...] = g
        if len(self.index):
            self._write_hits(h3, o)

    def _write_hits(self, h3, o) -> None:
        """Rows whose bin is in B get its prediction: a table lookup on the low bits of the
        first exact hash, confirmed on both (as the single-row ``dict``); rows in a slot that
        two bins of B share go through the sorted-hash :class:`BinIndex`."""
        key = h3[:, 0].astype(np.int64)
        key &= self.mask
        pos = self.slots[key]
        cand = np.flatnonzero(pos >= 0)
        if cand.size:
            p = pos[cand]
            ok = (self.pair[p, 0] == h3[cand, 0]) & (self.pair[p, 1] == h3[cand, 1])
            o[cand[ok]] = self.bin_pred[p[ok]]
        if self.crowded:
            rows = np.flatnonzero(pos == _CROWDED)
            if rows.size:
                hh = np.ascontiguousarray(h3[rows, :2])
                idx = self.index.lookup_hashed(_combine(hh), hh)
                hit = idx >= 0
                o[rows[hit]] = self.bin_pred[idx[hit]]

    # ------------------------------------------------------------------ one row
    @_QUIET
    def apply_row(self, u: np.ndarray, o: np.ndarray, check: bool, inplace: bool) -> None:
        """Write ``h(u)`` for one row ``u`` of length ``k`` into ``o`` (``inplace``: ``o`` is
        ``u``).

        The arithmetic of :meth:`apply_rows` on 1-D arrays (row sums may round differently, by
        about 1e-16), with a ``dict`` lookup of the row's bin instead of a sorted-hash search.
        Short rows (``k <= 32``) are summed as Python lists, cheaper than a numpy reduction.
        """
        short = self.k <= _SHORT
        if self.T is not None:
            if check:
                s = sum(u.tolist()) if short else np.dot(u, self.ones)
                if not abs(s - 1.0) <= SUM_TOL:
                    check_rows(u[None], np.array([s]), 0)
            if inplace:
                u = u.copy()
            np.log(u, out=o)
            np.multiply(o, self.inv_T, out=o)
            np.exp(o, out=o)
            e = sum(o.tolist()) if short else np.dot(o, self.ones)
            if not _E_MIN <= e <= _E_MAX:
                if check:  # a negative entry (log -> NaN): name it
                    check_rows(u[None], np.array([s]), 0)
                o[...] = scale_temperature(u[None] / u.sum(), self.T)[0]
            else:
                np.multiply(o, 1.0 / e, out=o)
            if not self.binned:
                return
            g = o
        else:
            s = sum(u.tolist()) if short else np.dot(u, self.ones)
            if check and not (abs(s - 1.0) <= SUM_TOL and u.min() >= 0):
                check_rows(u[None], np.array([s]), 0)
            g = u / s if abs(s - 1.0) * self.lam > 1e-6 else u
        t = np.multiply(g, self.lam)
        t += FLOOR_TOL
        np.floor(t, out=t)
        if not (check or self.T is not None):  # else g is in [0, 1]: clipping changes nothing
            np.minimum(t, self.lam, out=t)
            np.maximum(t, 0.0, out=t)
        pred = self.row_hits.get((t @ self.w).tobytes()) if self.row_hits else None
        if pred is not None:
            o[...] = pred
        elif self.rho:
            np.multiply(t, self.inv_lam, out=o)
            o += (self.lam - np.add.reduce(t)) * self.inv_klam
        elif not (inplace and g is u):
            o[...] = g
