"""Everything the daemon keeps per model, and its checkpoint. Pure: no I/O, no clock.

A :class:`ModelState` holds, for one model:

* the epochs' pools (:class:`lpcal.pools.PoolSet`): each joined sample goes to the pool
  ``layout.route([id])`` of the *filling* epoch (a blake2b hash of the event id, so a replay
  fills identical pools). An epoch is *sealed* at the exact sample that makes every pool full:
  the full pool set joins the ``sealed`` queue (waiting to be fitted) and the following samples,
  even those of the same batch, fill the next epoch. Epoch boundaries therefore depend only on
  the sequence of joined samples, not on batching or on when fits run, so a replay after a
  crash seals identical pools. ``pools`` is the oldest sealed epoch if any (the one to fit),
  else the filling one; ``start_new_epoch()`` hands ``pools`` off (pops the sealed epoch, or
  discards the filling pools for a drift refill / manual fit);
* the windowed monitor (:class:`daemon.monitor.WindowMonitor`) of the raw and calibrated
  predictor, and the triggers (:class:`daemon.trigger.Triggers`);
* the join buffer (:class:`daemon.join.JoinStore`) of half-joined events;
* the current bin map (its JSON bytes, exactly as published) and version;
* the epoch number, and the input offsets covered, ``{topic: {partition: next_offset}}``: the
  state reflects exactly the input messages before those offsets, so a restart seeks there.

:meth:`ModelState.to_checkpoint` serialises all of it to one orjson document;
:meth:`ModelState.from_checkpoint` validates and restores it (raising
:class:`lpcal.errors.ArtifactError` that names the model and the bad part). Round trips are
exact: pools, monitor sums, pending joins, bin map bytes and offsets compare equal.

``prescale = "temperature"`` is not supported by the streaming daemon yet (the pools would have
to hold bins of the temperature-scaled predictor, fitted before the epoch starts);
:meth:`ModelState.create` rejects it with an explanation.

Usage::

    st = ModelState.create("fraud-v3", k=3, ms=settings.model_settings("fraud-v3"),
                           join=settings.join)
    res = st.offer(model_batch)                       # join + pools + monitor; a ModelBatch
    st.advance_offsets("lpcal.predictions", 0, msg.offset + 1)
    f = st.check_triggers(now, busy=fit_in_flight)    # Firing | None
    if f and f.action == "refill":                    # drift: discard the filling pools
        st.start_new_epoch()
    if f and f.action == "fit":                       # pools_full (sealed) or manual (partial)
        pools = st.pools
        st.start_new_epoch()                          # hand them off
        bm = fit_pools(pools, ..., version=st.binmap_version + 1)   # in a worker
        st.install_binmap(bm.to_json(), bm.version)
    blob = st.to_checkpoint(); st2 = ModelState.from_checkpoint(blob)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from daemon.join import JoinResult, JoinStore
from daemon.monitor import WindowMonitor, WindowStats
from daemon.native import route_uniform_fast
from daemon.trigger import DriftTrigger, Firing, Triggers
from lpcal.errors import ArtifactError, InputError
from lpcal.levels import beta_for, bin_rows, lambda_for
from lpcal.pools import PoolLayout, PoolSet

__all__ = ["CHECKPOINT_FORMAT", "DEFAULT_POOL", "IngestResult", "ModelState",
           "binmap_calibrator", "layout_for"]

CHECKPOINT_FORMAT = "lpcal.model_state/2"
# /1 listed the join's recent ids as [id, state] pairs (/2: recent_ids + recent_expired); both
# restore. Earlier versions of the daemon cannot read /2 and say so (format mismatch).
READABLE_CHECKPOINT_FORMATS = ("lpcal.model_state/1", CHECKPOINT_FORMAT)
DEFAULT_POOL = 5_000
#: Sealed epochs waiting for their fit at which the daemon pauses the model's partition
#: (backpressure). Epochs are never dropped: every sealed epoch is fitted, in order, so the
#: published versions depend only on the input, not on how fast fits keep up.
MAX_SEALED = 4
Calibrator = Callable[[np.ndarray], np.ndarray]
CalibratorFactory = Callable[[bytes], Calibrator]

_CONFIG_KEYS = ("eps", "p", "delta", "sizing", "mu_pool", "pool", "variant", "prescale",
                "outside", "drift_threshold", "window_samples", "window_seconds",
                "drift_sustain_seconds", "drift_confidence", "drift_min_samples")


def binmap_calibrator(data: bytes) -> Calibrator:
    """Default calibrator factory: ``lpcal.binmap.BinMap.from_json(data).apply``."""
    from lpcal.binmap import BinMap

    bm = BinMap.from_json(data)
    return lambda probs: bm.apply(probs, check=False)


def _config_of(ms: Any) -> dict[str, Any]:
    """Plain dict of the model settings the state depends on (drift_threshold defaulted)."""
    cfg = {key: getattr(ms, key) for key in _CONFIG_KEYS}
    if cfg["drift_threshold"] is None:
        cfg["drift_threshold"] = cfg["eps"]
    cfg["p"] = float(cfg["p"])
    return cfg


def layout_for(cfg: Mapping[str, Any], k: int) -> PoolLayout:
    """Pool layout of an epoch: the paper's sizes (``theory``) or ``pool``/``mu_pool``.

    ``practical`` defaults: ``pool`` = 5000 samples per estimation pool, ``mu_pool`` = ``pool``.
    """
    from lpcal.sizing import practical_sizing, theory_sizing

    if cfg["sizing"] == "theory":
        sz = theory_sizing(cfg["eps"], cfg["p"], cfg["delta"], k, cfg["variant"])
    else:
        pool = int(cfg["pool"] or DEFAULT_POOL)
        sz = practical_sizing(cfg["eps"], cfg["p"], cfg["delta"], k,
                              mu_pool=int(cfg["mu_pool"] or pool), pool=pool,
                              variant=cfg["variant"])
    return sz.layout()


@dataclass
class IngestResult:
    """What one :meth:`ModelState.offer` / :meth:`ModelState.ingest` call did."""

    joined: int = 0                      # samples added to pools and monitor
    label_out_of_range: int = 0          # joined samples dropped: label >= k
    evicted: dict[str, int] = field(default_factory=dict)
    unmatched: dict[str, int] = field(default_factory=dict)
    sealed: int = 0                      # epochs sealed (pools became full) by this call

    @property
    def pools_full(self) -> bool:
        return self.sealed > 0


class ModelState:
    """Per-model pools, monitor, join buffer, triggers, bin map, epoch and offsets."""

    def __init__(self, model: str, k: int, config: Mapping[str, Any], layout: PoolLayout,
                 join: JoinStore, *, monitor: WindowMonitor | None = None,
                 triggers: Triggers | None = None,
                 calibrator_factory: CalibratorFactory = binmap_calibrator,
                 eval_interval: float = 1.0):
        self.model = model
        self.k = int(k)
        self.config = dict(config)
        self.lam = lambda_for(beta_for(self.config["eps"], self.config["p"]))
        if layout.k != self.k or layout.lam != self.lam:
            raise InputError(f"model {model!r}: layout has (k, lambda) = ({layout.k}, "
                             f"{layout.lam}), expected ({self.k}, {self.lam})")
        self.layout = layout
        self.filling = PoolSet(layout)        # receives the joined samples
        self.fill_epoch = 0                    # epoch number of ``filling``
        self.sealed: list[tuple[int, PoolSet]] = []  # full epochs, oldest first
        self.join = join
        self.monitor = monitor or WindowMonitor(
            self.k, self.lam, self.config["p"], window_samples=self.config["window_samples"],
            window_seconds=self.config["window_seconds"])
        self.triggers = triggers or Triggers(DriftTrigger(
            self.config["drift_threshold"], self.config["drift_sustain_seconds"],
            min_samples=self.config["drift_min_samples"]))
        self.binmap: bytes | None = None
        self.binmap_version = 0
        self.offsets: dict[str, dict[int, int]] = {}
        self.samples_total = 0
        self.dropped_labels = 0
        self._factory = calibrator_factory
        self._calibrator: Calibrator | None = None
        self.eval_interval = float(eval_interval)
        self._last_eval: tuple[float, dict[str, WindowStats | None]] | None = None

    @classmethod
    def create(cls, model: str, k: int, ms: Any, join: Any, *,
               calibrator_factory: CalibratorFactory = binmap_calibrator) -> ModelState:
        """New state from model settings ``ms`` (a ModelSettings) and join settings ``join``."""
        cfg = _config_of(ms)
        if cfg["prescale"] != "none":
            raise InputError(f"model {model!r}: prescale={cfg['prescale']!r} is not supported by "
                             "the streaming daemon yet; use prescale='none'")
        store = JoinStore(join.max_pending_per_model, join.ttl_seconds,
                          getattr(join, "recent_per_model", None))
        return cls(model, k, cfg, layout_for(cfg, k), store,
                   calibrator_factory=calibrator_factory)

    # ---------------------------------------------------------------- ingest
    def offer(self, mb: Any, now: float | None = None) -> IngestResult:
        """Join a :class:`daemon.events.ModelBatch` of this model and ingest what it completes."""
        if mb.model != self.model:
            raise InputError(f"batch of model {mb.model!r} offered to {self.model!r}")
        if mb.k not in (0, self.k):
            raise InputError(f"model {self.model!r}: batch has k={mb.k}, state has k={self.k}")
        jr: JoinResult = self.join.offer(self.model, mb.kind, mb.ids, mb.ts,
                                         mb.probs if mb.k else None, mb.labels, now)
        res = self.ingest(jr.ids, jr.probs, jr.labels, jr.ts)
        res.evicted, res.unmatched = jr.evicted, jr.unmatched
        return res

    def ingest(self, ids: list[str], probs: np.ndarray, labels: np.ndarray,
               ts: np.ndarray | None = None) -> IngestResult:
        """Add joined samples: route to pools (sealing epochs at their exact fill point), update
        the monitors (raw and, with a bin map, calibrated). Samples with ``label >= k`` (possible
        when an outcome arrived before the model's ``k`` was known) are dropped and counted."""
        labels = np.asarray(labels, dtype=np.int64)
        res = IngestResult()
        n = labels.shape[0]
        if n == 0:
            return res
        probs = np.asarray(probs, dtype=np.float64).reshape(n, self.k)
        ok = (labels >= 0) & (labels < self.k)
        if not ok.all():
            keep = np.flatnonzero(ok)
            res.label_out_of_range = int(n - keep.size)
            self.dropped_labels += res.label_out_of_range
            ids = [ids[i] for i in keep.tolist()]
            probs, labels = probs[keep], labels[keep]
            ts = None if ts is None else np.asarray(ts)[keep]
        if labels.size:
            c, h, pair = bin_rows(probs, self.lam)  # shared by the pools and the monitor
            route = self.filling.layout.route_uniforms(route_uniform_fast(ids))
            if self.filling.full:  # e.g. after a layout change
                self.seal()
                res.sealed += 1
            a = 0
            while a < route.size:
                cut = self._fill_point(route[a:])
                b = route.size if cut is None else a + cut + 1
                self.filling.add(route[a:b], None, labels[a:b], counts=c[a:b], hashes=h[a:b])
                if cut is not None:
                    self.seal()
                    res.sealed += 1
                a = b
            cal = self._calibrator(probs) if self._calibrator is not None else None
            self.monitor.update(probs, labels, ts, calibrated=cal, hashes=(h, pair))
        res.joined = int(labels.size)
        self.samples_total += res.joined
        return res

    def _fill_point(self, route: np.ndarray) -> int | None:
        """Position in ``route`` of the sample that makes every pool full (None: not reached)."""
        pos = -1
        lay = self.filling.layout
        for p, name in enumerate(lay.names):
            need = lay.targets[name] - self.filling.tables[name].total
            if need <= 0:
                continue
            occ = np.flatnonzero(route == p)
            if occ.size < need:
                return None
            pos = max(pos, int(occ[need - 1]))
        return pos if pos >= 0 else None

    # ---------------------------------------------------------------- lifecycle
    def advance_offsets(self, topic: str, partition: int, next_offset: int) -> None:
        """Record that input up to ``next_offset`` (exclusive) of ``topic[partition]`` is in."""
        parts = self.offsets.setdefault(topic, {})
        if next_offset > parts.get(int(partition), -1):
            parts[int(partition)] = int(next_offset)

    def evaluate(self) -> dict[str, WindowStats | None]:
        """Window metrics of both predictors, at the drift confidence ``z``."""
        return self.monitor.evaluate(self.config["drift_confidence"])

    def check_triggers(self, now: float, *, busy: bool = False,
                       stats: Mapping[str, WindowStats | None] | None = None
                       ) -> Firing | None:
        """Ask the triggers what to do at ``now`` (evaluates the monitor unless ``stats``).

        ``pools_full`` is "a sealed epoch is waiting to be fitted". Evaluating the window costs
        O(window bins * k), so it is redone at most every ``eval_interval`` seconds of ``now``
        (the drift trigger works at the scale of ``drift_sustain_seconds``); cheap to call per
        batch."""
        if stats is None:
            last = self._last_eval
            if last is not None and 0.0 <= now - last[0] < self.eval_interval:
                stats = last[1]
            else:
                stats = self.evaluate()
                self._last_eval = (now, stats)
        return self.triggers.check(now=now, pools_full=bool(self.sealed),
                                   stats=stats.get("calibrated"), busy=busy)

    @property
    def pools(self) -> PoolSet:
        """The pools to fit next: the oldest sealed (full) epoch, else the filling one."""
        return self.sealed[0][1] if self.sealed else self.filling

    @property
    def epoch(self) -> int:
        """Epoch number of :attr:`pools`."""
        return self.sealed[0][0] if self.sealed else self.fill_epoch

    def seal(self) -> int:
        """Queue the filling pools (even if not full) and start filling the next epoch (with
        the current ``layout``).

        Returns the sealed epoch number. Nothing is ever dropped: the queue is bounded by the
        caller, which stops feeding samples while :attr:`backlogged` (see :data:`MAX_SEALED`)."""
        epoch = self.fill_epoch
        self.sealed.append((epoch, self.filling))
        self.filling = PoolSet(self.layout)
        self.fill_epoch += 1
        return epoch

    @property
    def backlogged(self) -> bool:
        """True while :data:`MAX_SEALED` or more sealed epochs wait for their fit: stop feeding
        this model until fits catch up (one batch may seal several epochs, so the queue can
        exceed the mark by what one batch holds)."""
        return len(self.sealed) >= MAX_SEALED

    def start_new_epoch(self, layout: PoolLayout | None = None) -> None:
        """Hand off :attr:`pools`: pop the oldest sealed epoch (its fit was launched) or, with
        none sealed, discard the filling pools and start the next epoch (drift refill, manual
        fit of partial pools). ``layout`` (same k and lambda) applies to epochs started later."""
        if layout is not None:
            if (layout.k, layout.lam) != (self.k, self.lam):
                raise InputError("a new layout must keep k and lambda")
            self.layout = layout
        if self.sealed:
            self.sealed.pop(0)
            return
        self.filling = PoolSet(self.layout)
        self.fill_epoch += 1

    def install_binmap(self, data: bytes, version: int) -> None:
        """Use this bin map from now on: the calibrated window restarts, drift is rearmed."""
        self._calibrator = self._factory(bytes(data))
        self.binmap = bytes(data)
        self.binmap_version = int(version)
        self.monitor.reset("calibrated")
        self.triggers.recalibrated()
        self._last_eval = None

    @property
    def calibrator(self) -> Calibrator | None:
        return self._calibrator

    # ---------------------------------------------------------------- checkpoint
    def to_dict(self) -> dict[str, Any]:
        cfg = dict(self.config)
        cfg["p"] = "inf" if math.isinf(cfg["p"]) else cfg["p"]
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.model,
            "k": self.k,
            "config": cfg,
            "fill_epoch": self.fill_epoch,
            "filling": self.filling.to_dict(),
            "sealed": [{"epoch": e, "pools": ps.to_dict()} for e, ps in self.sealed],
            "monitor": self.monitor.to_dict(),
            "join": self.join.to_dict(),
            "triggers": self.triggers.to_dict(),
            "binmap": None if self.binmap is None else self.binmap.decode("utf-8"),
            "binmap_version": self.binmap_version,
            "offsets": {t: {str(p): o for p, o in sorted(parts.items())}
                        for t, parts in sorted(self.offsets.items())},
            "samples_total": self.samples_total,
            "dropped_labels": self.dropped_labels,
        }

    def to_checkpoint(self) -> bytes:
        """The whole state as one orjson document (key: the model id)."""
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_checkpoint(cls, data: bytes, *,
                        calibrator_factory: CalibratorFactory = binmap_calibrator
                        ) -> ModelState:
        """Validate and restore a checkpoint; raise :class:`ArtifactError` naming the problem."""
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ArtifactError(f"checkpoint is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ArtifactError("checkpoint is not a JSON object")
        fmt = d.get("format")
        if fmt not in READABLE_CHECKPOINT_FORMATS:
            raise ArtifactError(f"checkpoint format {fmt!r}, expected one of "
                                f"{', '.join(READABLE_CHECKPOINT_FORMATS)}")
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise ArtifactError("checkpoint: 'model' must be a non-empty string")
        where = f"checkpoint of model {model!r}"
        part = "header"
        try:
            k = int(d["k"])
            cfg = dict(d["config"])
            missing = [key for key in _CONFIG_KEYS if key not in cfg]
            if missing:
                raise ValueError(f"config lacks {missing}")
            cfg["p"] = math.inf if cfg["p"] == "inf" else float(cfg["p"])
            part = "filling"
            pools = PoolSet.from_dict(d["filling"])
            part = "sealed"
            sealed = [(int(item["epoch"]), PoolSet.from_dict(item["pools"]))
                      for item in d["sealed"]]
            part = "monitor"
            monitor = WindowMonitor.from_dict(d["monitor"], where=f"{where}: monitor")
            part = "join"
            join = JoinStore.from_dict(d["join"], where=f"{where}: join")
            part = "triggers"
            triggers = Triggers.from_dict(d["triggers"])
            part = "header"
            st = cls(model, k, cfg, pools.layout, join, monitor=monitor, triggers=triggers,
                     calibrator_factory=calibrator_factory)
            st.filling = pools
            for e, ps in sealed:
                if (ps.layout.k, ps.layout.lam) != (k, st.lam):
                    raise ValueError(f"sealed epoch {e} has (k, lambda) = "
                                     f"({ps.layout.k}, {ps.layout.lam})")
            st.sealed = sealed
            if (monitor.k, monitor.lam) != (k, st.lam):
                raise ValueError(f"monitor has (k, lambda) = ({monitor.k}, {monitor.lam})")
            st.fill_epoch = int(d["fill_epoch"])
            st.samples_total = int(d["samples_total"])
            st.dropped_labels = int(d["dropped_labels"])
            part = "offsets"
            for topic, parts in dict(d["offsets"]).items():
                for p, o in dict(parts).items():
                    if int(o) < 0:
                        raise ValueError(f"negative offset {o} for {topic}[{p}]")
                    st.offsets.setdefault(str(topic), {})[int(p)] = int(o)
            part = "binmap"
            if d["binmap"] is not None:
                st._calibrator = calibrator_factory(d["binmap"].encode("utf-8"))
                st.binmap = d["binmap"].encode("utf-8")
            st.binmap_version = int(d["binmap_version"])
        except (InputError, ArtifactError) as e:
            raise ArtifactError(f"{where}: {part}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"{where}: {part}: malformed ({type(e).__name__}: {e})") from None
        return st

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelState):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (f"ModelState(model={self.model!r}, k={self.k}, epoch={self.fill_epoch}, "
                f"filling={self.filling.total}, sealed={len(self.sealed)}, "
                f"pending={self.join.pending()}, "
                f"binmap_version={self.binmap_version})")
