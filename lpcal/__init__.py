"""lpcal: multiclass calibration under lp error (Bairaktari & Nguyen), as a numpy library.

The public API::

    from lpcal import fit, BinMap, FitSpec, metrics
    bm = fit(probs, labels, eps=0.05, p=float("inf"))   # certified default (see lpcal.calibrate)
    calibrated = bm.apply(new_probs)                      # the bin map h
    bm.certificate                                        # a Certificate: held-out Err_p bound
    fit(probs, labels, FitSpec(eps=0.05, p=2, mode="paper"))  # Algorithm 2 as published
    metrics.err_p(calibrated, labels, lam=20, p=2)        # evaluation

Fitting from pools a stream filled (:func:`fit_pools`) is public too; the pools themselves
(:mod:`lpcal.pools`) and their sizing (:mod:`lpcal.sizing`) are imported from their modules.
"""

from importlib import metadata as _metadata

from lpcal import metrics
from lpcal.binmap import BinMap
from lpcal.calibrate import fit, fit_pools
from lpcal.certificate import Certificate
from lpcal.errors import ArtifactError, InputError, LpcalError
from lpcal.spec import EPS_AUTO, FitSpec, Mode, Outside, Prescale, SizingRule, Variant

try:  # one version, pyproject.toml's, as installed
    __version__ = _metadata.version("lpcal")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["EPS_AUTO", "ArtifactError", "BinMap", "Certificate", "FitSpec", "InputError",
           "LpcalError", "Mode", "Outside", "Prescale", "SizingRule", "Variant", "fit",
           "fit_pools", "metrics"]
