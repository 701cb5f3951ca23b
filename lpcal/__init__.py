"""lpcal: multiclass calibration under lp error (Bairaktari & Nguyen), as a numpy library.

The public API::

    from lpcal import fit, fit_pools, BinMap, metrics
    bm = fit(probs, labels, eps=0.05, p=float("inf"))   # Algorithm 2 on one labelled sample
    calibrated = bm.apply(new_probs)                      # the bin map h
"""

from lpcal import metrics
from lpcal.binmap import BinMap
from lpcal.calibrate import fit, fit_pools
from lpcal.errors import ArtifactError, InputError, LpcalError
from lpcal.pools import CountTable, PoolLayout, PoolSet
from lpcal.sizing import practical_sizing, theory_sizing

__version__ = "0.1.0"
__all__ = ["ArtifactError", "BinMap", "CountTable", "InputError", "LpcalError", "PoolLayout",
           "PoolSet", "fit", "fit_pools", "metrics", "practical_sizing", "theory_sizing"]
