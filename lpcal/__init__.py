"""lpcal: multiclass calibration under lp error (Bairaktari & Nguyen), as a numpy library.

The public API::

    from lpcal import fit, fit_pools, BinMap, FitSpec, metrics
    bm = fit(probs, labels, eps=0.05, p=float("inf"))   # certified default (see lpcal.calibrate)
    calibrated = bm.apply(new_probs)                      # the bin map h
    bm.certificate                                        # held-out Err_p bound, selection
    fit(probs, labels, FitSpec(eps=0.05, p=2, mode="paper"))  # Algorithm 2 as published
"""

from importlib import metadata as _metadata

from lpcal import metrics
from lpcal.binmap import BinMap
from lpcal.calibrate import fit, fit_pools
from lpcal.errors import ArtifactError, InputError, LpcalError
from lpcal.pools import CountTable, PoolLayout, PoolSet
from lpcal.sizing import practical_sizing, theory_sizing
from lpcal.spec import FitSpec

try:  # one version, pyproject.toml's, as installed
    __version__ = _metadata.version("lpcal")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["ArtifactError", "BinMap", "CountTable", "FitSpec", "InputError", "LpcalError",
           "PoolLayout", "PoolSet", "fit", "fit_pools", "metrics", "practical_sizing",
           "theory_sizing"]
