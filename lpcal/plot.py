"""Reliability diagram (top-label), drawn with matplotlib (optional extra ``lpcal[plot]``)."""

from __future__ import annotations

import numpy as np

from lpcal.errors import InputError


def reliability_diagram(path: str, curves: dict[str, tuple[np.ndarray, np.ndarray]],
                        n_bins: int = 15) -> str:
    """Write a PNG with one top-label reliability curve per ``name -> (probs, labels)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the install
        raise InputError("--plot needs matplotlib: pip install 'lpcal[plot]'") from None
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    edges = np.linspace(0, 1, n_bins + 1)
    for name, (x, y) in curves.items():
        conf = x.max(axis=1)
        hit = (x.argmax(axis=1) == y).astype(float)
        b = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
        cnt = np.bincount(b, minlength=n_bins)
        ok = cnt > 0
        acc = np.bincount(b, weights=hit, minlength=n_bins)[ok] / cnt[ok]
        cf = np.bincount(b, weights=conf, minlength=n_bins)[ok] / cnt[ok]
        ax.plot(cf, acc, "o-", label=name)
    ax.set_xlabel("confidence (top label)")
    ax.set_ylabel("accuracy")
    ax.set_title("Reliability diagram")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
