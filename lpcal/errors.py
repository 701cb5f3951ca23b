"""Exceptions raised by lpcal. Every message says what was wrong and where."""


class LpcalError(Exception):
    """Base class of lpcal's errors."""


class InputError(LpcalError, ValueError):
    """Bad input data or parameters (shape, NaN, range, simplex, labels, keys)."""


class ArtifactError(LpcalError, ValueError):
    """A bin-map artifact is corrupt, truncated, tampered with or incompatible."""
