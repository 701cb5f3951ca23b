"""Example data shipped with lpcal (see ``lpcal/data/README.md`` for provenance and license)."""

from __future__ import annotations

from importlib import resources

import numpy as np

from lpcal.errors import InputError
from lpcal.io import load_predictions

_DATA = "data"


def available_records() -> list[str]:
    """Names of the bundled prediction records (file stems under ``lpcal/data``)."""
    root = resources.files("lpcal").joinpath(_DATA)
    return sorted(p.name[: -len(".npz")] for p in root.iterdir() if p.name.endswith(".npz"))


def load_cifar_record(name: str = "wideresnet-16-4-cifar-10") -> tuple[np.ndarray, np.ndarray]:
    """Load a bundled CIFAR prediction record as ``(probs, labels)``: float64 (n, k), int64 (n,).

    The record is read through :mod:`importlib.resources`, so it works from an installed wheel.
    Rows are validated (simplex within 1e-4) but not renormalised.
    """
    names = available_records()
    if name not in names:
        raise InputError(f"unknown record {name!r}; bundled records: {names}")
    ref = resources.files("lpcal").joinpath(_DATA, f"{name}.npz")
    with resources.as_file(ref) as path:
        probs, labels = load_predictions(path)
    return probs, labels
