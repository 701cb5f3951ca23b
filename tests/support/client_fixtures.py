"""Fixtures shared by the tests of the downstream bin-map client (``lpcal.client``):
``tests/test_client.py`` (no broker) and ``tests/integration/test_client_kafka.py`` (the embedded
broker).

Real fitted bin maps (``lpcal.calibrate.fit`` on small synthetic data); two maps with different
``eps`` (hence different lambda) give different outputs on every input row, so a call that mixed
two maps would match neither precomputed output. Each suite builds its own pair in a
module-scoped ``maps`` fixture (``fitted_maps`` with its own seeds). Nothing here imports
``daemon`` or a Kafka package.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import orjson

from lpcal.binmap import BinMap
from lpcal.calibrate import fit

MODEL = "fraud-v3"


def synthetic_data(seed, n=8000, k=3, mix=0.6):
    rng = np.random.default_rng(seed)
    centres = rng.dirichlet(np.ones(k) * 0.6, size=3)
    f = centres[rng.integers(0, 3, size=n)] + rng.dirichlet(np.ones(k), size=n) * 0.04
    f /= f.sum(axis=1, keepdims=True)
    q = (1 - mix) * f + mix * np.roll(f, -1, axis=1)
    y = np.minimum((q.cumsum(axis=1) < rng.random((n, 1))).sum(axis=1), k - 1)
    return f, y


def fitted_maps(data_seed: int, x_seed: int, n_x: int) -> SimpleNamespace:
    """Two real fitted maps of MODEL (different eps -> different lambda) and test inputs:
    ``v1`` and ``v2`` (versions 1 and 2), ``x`` (``n_x`` rows) and their outputs ``out1``,
    ``out2``."""
    f, y = synthetic_data(data_seed)
    v1 = fit(f, y, eps=0.3, p=2.0, seed=0, model_id=MODEL, mode="paper").with_version(1)
    v2 = fit(f, y, eps=0.2, p=2.0, seed=1, model_id=MODEL, mode="paper").with_version(2)
    x = np.random.default_rng(x_seed).dirichlet(np.ones(3), size=n_x)
    out1, out2 = v1.apply(x), v2.apply(x)
    # every row differs, so a result mixing the two maps equals neither output
    assert (np.abs(out1 - out2).max(axis=1) > 1e-9).all(), "v1 and v2 agree on some row"
    return SimpleNamespace(v1=v1, v2=v2, x=x, out1=out1, out2=out2)


def flip_digit(data: bytes) -> bytes:
    """Change one digit inside the preds section: still valid JSON, checksum no longer matches."""
    i = data.index(b'"preds"')
    j = next(p for p in range(i, len(data)) if data[p:p + 1].isdigit() and data[p:p + 1] != b"0")
    return data[:j] + (b"0" if data[j:j + 1] != b"0" else b"1") + data[j + 1:]


def resigned(obj: dict) -> bytes:
    """Re-sign edited content with a valid checksum (what a buggy producer could publish)."""
    obj = {k: v for k, v in obj.items() if k != "checksum"}
    obj["checksum"] = BinMap._digest(obj)
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def schema_future(data: bytes) -> bytes:
    """``data`` as schema 3 (a version this lpcal cannot read), with a valid checksum."""
    return resigned(dict(orjson.loads(data), schema=3))
