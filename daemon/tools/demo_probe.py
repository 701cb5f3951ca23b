"""What ``make demo`` reads of the running daemon: only its public HTTP surface (``/readyz``,
``/metrics``, ``/v1/models/<id>/binmap``), as an operator's tools and a client would.

:func:`scrape` returns ``{metric sample name: [(labels, value), ...]}``; :func:`value` picks the
first sample whose labels include the given ones; :func:`statistic` reads the calibrated
predictor's windowed debiased statistic with its standard error (the change test's inputs).
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

#: the change test's statistics the demo prints, in order
SHOWN_STATISTICS = ("confidence_gap", "ece_top", "ece_classwise")


def free_port() -> int:
    """A free TCP port on the loopback interface (for the daemon's HTTP server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """``(status, body)`` of a GET; ``(0, b"")`` when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def scrape(base: str) -> dict:
    """The daemon's ``/metrics`` by sample name (empty when it did not answer 200)."""
    status, body = get(base + "/metrics")
    out: dict = {}
    if status != 200:
        return out
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(metrics: dict, name: str, **labels) -> float | None:
    """The first sample of ``name`` whose labels include ``labels`` (None: no such sample)."""
    for lab, v in metrics.get(name, []):
        if all(lab.get(k) == v_ for k, v_ in labels.items()):
            return v
    return None


def statistic(metrics: dict, model: str, name: str) -> tuple[float, float] | None:
    """The calibrated predictor's windowed debiased statistic ``name`` and its standard error."""
    v = value(metrics, "lpcal_calibration_statistic", model=model, predictor="calibrated",
              statistic=name)
    se = value(metrics, "lpcal_calibration_statistic_stderr", model=model,
               predictor="calibrated", statistic=name)
    return None if v is None or se is None else (v, se)


def format_statistics(metrics: dict, model: str) -> str:
    """``confidence_gap +0.0123 ± 0.0040, ...`` for ``model`` (the shown statistics it has)."""
    parts = []
    for name in SHOWN_STATISTICS:
        s = statistic(metrics, model, name)
        if s is not None:
            parts.append(f"{name} {s[0]:+.4f} ± {s[1]:.4f}")
    return ", ".join(parts) or "(no statistics yet)"
