"""Exceptions raised by lpcal. Every message says what was wrong and where."""


class LpcalError(Exception):
    """Base class of lpcal's errors."""


class InputError(LpcalError, ValueError):
    """Bad input data or parameters (shape, NaN, range, simplex, labels, keys)."""


class ArtifactError(LpcalError, ValueError):
    """A bin-map artifact is corrupt, truncated, tampered with or incompatible."""


def shown(value: object) -> str:
    """``value`` for an error message: numpy scalars as plain numbers (``1.1``, not
    ``np.float64(1.1)``), anything else as its ``repr``."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        try:
            value = item()
        except (TypeError, ValueError):
            pass
    return repr(value)
