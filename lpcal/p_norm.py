"""The exponent ``p`` of the lp calibration error ``Err_p``: its domain, in words, and
:func:`parse_p`, the one place that reads a ``p`` from a number or a string.

``Err_p`` is defined for ``1 <= p <= inf``; a fit needs ``p > 1`` (Algorithm 2's per-cell target
``beta`` goes to 0 as ``p -> 1``). Every message about a bad ``p`` (the library, the ``lpcal``
command line, the daemon's settings) uses :data:`P_DOMAIN` or :data:`ERR_P_DOMAIN`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from lpcal.errors import InputError, shown

__all__ = ["ERR_P_DOMAIN", "P_DOMAIN", "parse_p"]

P_DOMAIN = "a number > 1, or inf"
"""The ``p`` of a fit, in words (every message about it uses these): ``1 < p <= inf``. ``Err_p``
is defined for ``p >= 1`` (:data:`ERR_P_DOMAIN`: :mod:`lpcal.metrics` evaluates it there), but
Algorithm 2's per-cell target ``beta = eps^(p/(p-1)) / 2^(1/(p-1))`` needs ``p > 1``
(``p -> 1`` sends it to 0)."""
ERR_P_DOMAIN = "a number >= 1, or inf (Err_p is defined for p >= 1)"
"""The ``p`` at which ``Err_p`` is evaluated, in words: ``1 <= p <= inf``
(:func:`parse_p` with ``evaluate=True``)."""

_INF_WORDS = frozenset({"inf", "+inf", "infinity", "+infinity"})


def parse_p(value: Any, name: str = "p", *, evaluate: bool = False) -> float:
    """``value`` as the ``p`` of a fit: a real number > 1, or infinity (``math.inf`` or the
    strings ``"inf"``/``"infinity"``, any case); else :class:`InputError` naming ``name``.
    ``evaluate=True``: the ``p`` at which ``Err_p`` is evaluated, which may also be 1.

    The one definition of p's domain (:data:`P_DOMAIN`, :data:`ERR_P_DOMAIN`), used by
    :class:`lpcal.spec.FitSpec`, the ``lpcal`` command line, the daemon's settings and
    :mod:`lpcal.metrics`.
    """
    v = value
    domain = ERR_P_DOMAIN if evaluate else P_DOMAIN
    if isinstance(v, str):
        text = v.strip().lower()
        if text in _INF_WORDS:
            return math.inf
        try:
            v = float(text)
        except ValueError:
            raise InputError(f"{name} must be {domain}, got {value!r}") from None
    if (isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v)
            or not (v >= 1.0 if evaluate else v > 1.0)):
        raise InputError(f"{name} must be {domain}, got {shown(value)}")
    return float(v)
