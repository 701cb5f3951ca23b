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
  predictor, with the change test of the live map (:class:`daemon.drift.ChangeDetector`, reset
  with the calibrated window when a map is installed), and the triggers
  (:class:`daemon.trigger.Triggers`);
* the join buffer (:class:`daemon.join.JoinStore`) of half-joined events;
* the ``sample_rate`` (the model setting; not checkpointed, the settings decide it at every
  start): :meth:`ModelState.offer` keeps an event only when ``u = route_uniform(id) <
  sample_rate`` (:meth:`ModelState.sample`), *before* the join, so a prediction and its outcome
  are kept or dropped together in either arrival order, on every replica and in every replay
  (``u`` is a blake2b hash of the id alone). The kept samples are routed to the pools with
  ``u / sample_rate``: the same hash, reused; given ``u < rate`` it is again uniform on [0, 1)
  and independent of the sample's content, so the pools and the monitor see a uniform random
  subsample (unbiased estimates; only their variance grows). Routing with ``u`` itself would
  send every kept sample to the pools that cover [0, rate);
* the current bin map (its JSON bytes, exactly as published) and version;
* the epoch number, and the input offsets covered, ``{topic: {partition: next_offset}}``: the
  state reflects exactly the input messages before those offsets, so a restart seeks there.

:meth:`ModelState.to_checkpoint` serialises all of it to one orjson document;
:meth:`ModelState.from_checkpoint` validates and restores it (raising
:class:`lpcal.errors.ArtifactError` that names the model and the bad part). Round trips are
exact: pools, monitor sums, pending joins, bin map bytes and offsets compare equal.

Fit modes (``mode`` in the settings): in the **certified** default every epoch's layout has
``warmup`` samples, taken first in arrival order, that fit the epoch's temperature
(:class:`lpcal.precalibrate.TemperatureGrid`); the pools then hold bins of the temperature-scaled
predictor, and a ``holdout`` share (routed like a pool) collects the held-out sums that certify
the fitted bin map (:func:`lpcal.calibrate.fit_pools`). :meth:`lpcal.pools.PoolSet.add_samples`
does the routing and stops at the exact fill point. The **paper** mode has neither (warm-up and
held-out share 0).

A state keeps what it runs as two typed specs (:mod:`daemon.specs`), built by the model settings
(:meth:`daemon.settings.ModelSettings.epoch_spec`, ``monitor_spec``): :attr:`ModelState.epoch_spec`
(its :class:`lpcal.spec.FitSpec`, :attr:`ModelState.fit_spec`, plus the held-out and warm-up
counts) and :attr:`ModelState.monitor_spec`. The checkpoint stores both, flattened, as its
``config`` object (:data:`CONFIG_KEYS`, every default resolved; the document format of
``lpcal.model_state/3``, unchanged); a checkpoint written before the fit mode keys existed
restores with the paper mode's values it ran with, one written before the change test with its
defaults.

Recovery modes (``recovery`` in the settings, :class:`daemon.specs.OnlineSpec`; the settings
default to ``online`` in the certified mode, ``epochs`` in the paper's): **epochs** is all of
the above. In the **online** mode the joined samples feed an
:class:`lpcal.online.OnlineCalibrator` instead of the epochs' pools, with the same routing
uniforms (``u / sample_rate``): it ends its warm-up when the temperature is determined, keeps
pools and held-out samples over a sliding window and publishes a candidate only when held-out
data says it beats the live map. The state installs every map the calibrator publishes at the
exact sample it was published (the monitor's calibrated window restarts there) and
:class:`IngestResult` carries the calibrator's events: ``published`` (maps for the caller to
publish), ``fit_requests`` (:class:`lpcal.online.FitRequest`: run
:func:`lpcal.online.run_fit` in a worker, then :meth:`ModelState.complete_fit`) and
``blocked``. While blocked (the stream is at the sample where a requested fit takes effect and
it is not back) the joined samples not yet consumed wait in ``backlog`` and
:attr:`ModelState.backlogged` is true: pause the input until :meth:`ModelState.complete_fit`.
A drift refill calls :meth:`ModelState.notify_drift` (only post-drift buckets count), a manual
request :meth:`ModelState.request_fit` (the next decision point fits; champion/challenger still
decides). The document of an online state (:meth:`ModelState.to_dict`) is
``lpcal.model_state/4`` (the /3 document plus ``recovery``, ``online`` and ``backlog``). A
restore that finds a newer map on the bin-map topic than the checkpoint's hands it to
:meth:`ModelState.adopt_published`: the replay publishes the same maps again (installed, not
sent) and the topic's bytes are installed when it reaches their version.

:meth:`ModelState.to_checkpoint` writes ``lpcal.model_state/6`` (:data:`PACKED_CHECKPOINT_FORMAT`):
the /3 or /4 document with every count table and held-out sums as packed little-endian arrays
(no per-bin Python work; /5 did the same), and, new in /6, the monitor's sums as they are
held (each bucket's merged sums and the sums added since, each one packed string,
:func:`daemon.monitor.pack_one_sums`, instead of one per array; nothing is merged to write
them), the online window's loss grids packed (:meth:`lpcal.challenger.LossGrid.to_dict`), and
the empty count tables of a pool set left out (:meth:`lpcal.pools.PoolSet.to_dict`): a few
encoder calls per part instead of one per array, which is what a model with few samples pays.
The parts that did not change since the last checkpoint (config, bin map, sealed epochs, the
monitor's sums, the online window's sealed buckets and maps, count tables of at least
:data:`lpcal.pools.MEMO_MIN_PAIRS` pairs) are taken from a byte-bounded cache
(:class:`CheckpointCache`). Every earlier format still restores; a daemon older than /6 cannot
read /6.

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
        bm = fit_pools(pools, st.fit_spec, seed=..., model_id=st.model,
                       version=st.binmap_version + 1)                # in a worker
        st.install_binmap(bm.to_json(), bm.version)
    blob = st.to_checkpoint(); st2 = ModelState.from_checkpoint(blob)
"""

from __future__ import annotations

import base64
import dataclasses
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from daemon.join import JoinResult, JoinStore
from daemon.monitor import WindowMonitor, WindowStats
from daemon.native import route_uniform_fast
from daemon.specs import EpochSpec, MonitorSpec, OnlineSpec
from daemon.state_budget import EPOCH_SHARE, MONITOR_SHARE, SEALED_SHARE
from daemon.trigger import Firing, Triggers
from lpcal.binmap import BinMap
from lpcal.errors import ArtifactError, InputError
from lpcal.levels import bin_rows
from lpcal.online import Event, FitRequest, OnlineCalibrator
from lpcal.pools import PoolLayout, PoolSet
from lpcal.spec import FitSpec

__all__ = ["CHECKPOINT_FORMAT", "CONFIG_KEYS", "IngestResult", "ModelState",
           "binmap_calibrator"]

#: The format :meth:`ModelState.to_checkpoint` writes: the document of /3 (epochs) or /4
#: (online), with every count table and held-out sums as packed little-endian arrays
#: (:meth:`lpcal.pools.CountTable.to_dict`) instead of bin keys and integer lists, the monitor's
#: sums (as held: merged and added since) and the online window's loss grids packed, empty
#: count tables left out.
PACKED_CHECKPOINT_FORMAT = "lpcal.model_state/6"
#: The format of the first packed checkpoints: /6's document with the monitor's sums as one
#: base64 string per array, every table of a pool set (empty ones too); read, no longer written.
PACKED_5_CHECKPOINT_FORMAT = "lpcal.model_state/5"
#: The format of :meth:`ModelState.to_dict` of an epochs-mode state (written by :meth:`to_checkpoint`
#: before /5).
CHECKPOINT_FORMAT = "lpcal.model_state/3"
#: The format of an online-mode state: /3 plus ``recovery``, ``online`` and ``backlog``.
ONLINE_CHECKPOINT_FORMAT = "lpcal.model_state/4"
# /1 listed the join's recent ids as [id, state] pairs (/2: recent_ids + recent_expired); /3 adds
# the fit mode keys and, in the pools, the warm-up grid, the temperature and the held-out sums.
# All three restore (/1 and /2 as the paper's mode, which is what they ran). Earlier versions of
# the daemon cannot read /3 and say so (format mismatch): a certified epoch is not a paper one.
READABLE_CHECKPOINT_FORMATS = ("lpcal.model_state/1", "lpcal.model_state/2",
                               CHECKPOINT_FORMAT, ONLINE_CHECKPOINT_FORMAT,
                               PACKED_5_CHECKPOINT_FORMAT, PACKED_CHECKPOINT_FORMAT)
#: At most this many bytes of encoded checkpoint parts are kept per model between checkpoints
#: (:class:`CheckpointCache`; a quarter of the model's byte budget if that is smaller).
CHECKPOINT_CACHE_BYTES = 1 << 20
#: Sealed epochs waiting for their fit at which the daemon pauses the model's partition
#: (backpressure). Epochs are never dropped: every sealed epoch is fitted, in order, so the
#: published versions depend only on the input, not on how fast fits keep up.
MAX_SEALED = 4
Calibrator = Callable[[np.ndarray], np.ndarray]
CalibratorFactory = Callable[[bytes], Calibrator]

#: The keys of a checkpoint's ``config`` object for the :class:`EpochSpec`: its fit spec's
#: options (``pool`` for ``pool_size``; ``prescale`` and ``outside`` resolved), then its own.
_EPOCH_KEYS = ("eps", "p", "delta", "sizing", "mu_pool", "pool", "variant", "mode", "prescale",
               "outside", "holdout", "warmup")
#: The keys for the :class:`MonitorSpec`: its fields.
_MONITOR_KEYS = tuple(f.name for f in dataclasses.fields(MonitorSpec))
#: The keys of a checkpoint's ``config`` object, in the order written.
CONFIG_KEYS = _EPOCH_KEYS + _MONITOR_KEYS
#: The change test's settings and the defaults a checkpoint written before them restores with.
_CHANGE_CONFIG = {"drift_false_alarm_rate": 1e-7, "drift_baseline_samples": 5_000,
                  "drift_min_shift": 0.01}
#: Config keys added with the certified mode, and the values a checkpoint written before them
#: effectively ran with (the paper's mode: no pre-calibration, no held-out share, no warm-up).
_LEGACY_CONFIG = {"mode": "paper", "prescale": "none", "holdout": 0, "warmup": 0}


def binmap_calibrator(data: bytes) -> Calibrator:
    """Default calibrator factory: ``lpcal.binmap.BinMap.from_json(data).apply``."""
    from lpcal.binmap import BinMap

    bm = BinMap.from_json(data)
    return lambda probs: bm.apply(probs, check=False)


def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def _encode_backlog(backlog: tuple) -> dict[str, Any]:
    """The backlog's arrays, exact (little-endian base64)."""
    probs, labels, u, ts = backlog
    return {"n": int(labels.size), "probs": _b64(probs, "<f8"), "labels": _b64(labels, "<i8"),
            "uniforms": _b64(u, "<f8"), "ts": None if ts is None else _b64(ts, "<f8")}


def _decode_backlog(d: Mapping[str, Any], k: int) -> tuple:
    """Inverse of :func:`_encode_backlog` (``ValueError`` naming what is wrong)."""
    n = int(d["n"])

    def arr(key: str, dtype: str, size: int) -> np.ndarray:
        raw = base64.b64decode(d[key], validate=True)
        if len(raw) != 8 * size:
            raise ValueError(f"backlog {key}: {len(raw)} bytes, expected {8 * size}")
        return np.frombuffer(raw, dtype).astype(dtype[1:]).copy()

    probs = arr("probs", "<f8", n * k).reshape(n, k)
    labels, u = arr("labels", "<i8", n), arr("uniforms", "<f8", n)
    ts = None if d["ts"] is None else arr("ts", "<f8", n)
    if n < 1 or labels.min() < 0 or labels.max() >= k or not (
            (u >= 0) & (u < 1)).all() or not np.isfinite(probs).all():
        raise ValueError("backlog: empty, or labels, uniforms or probabilities out of range")
    return probs, labels, u, ts


_SCALARS = (int, float, str, bool, type(None))


def _weak(x: object) -> object:
    """A weak reference to ``x`` where it takes one (arrays, most objects), so that a cache
    entry does not keep replaced parts alive; scalars and other objects as they are."""
    if type(x) in _SCALARS:
        return x
    try:
        return weakref.ref(x)
    except TypeError:
        return x


def _same(kept: tuple, refs: tuple) -> bool:
    """The refs of a cache entry still hold: the same objects (identity; a weak reference
    still pointing to it) and equal scalars."""
    return len(kept) == len(refs) and all(
        (k() is y if type(k) is weakref.ref else k is y)
        or (type(k) is type(y) and type(y) in _SCALARS and k == y)
        for k, y in zip(kept, refs))


class CheckpointCache:
    """Encoded parts of one model's checkpoint, kept from one checkpoint to the next so that
    parts that did not change are not encoded again: the config, the bin map's JSON string,
    sealed epochs, the filling epoch's tables (those of at least
    :data:`lpcal.pools.MEMO_MIN_PAIRS` pairs: smaller ones cost less to pack than to look up),
    the monitor's buckets, the online window's sealed buckets and maps, a fit's frozen pools.

    Called as ``cache(owner, refs, make)``: the encoded ``make()`` of ``owner`` (an
    :class:`orjson.Fragment`, embedded as is by ``orjson.dumps``) unless the entry of ``owner``
    was made with the same ``refs`` (identical objects, equal scalars: what the part depends
    on). ``owner`` and the refs are held by weak reference where they take one, so that
    replaced parts are freed (an entry whose owner died never matches, whoever reuses its
    ``id``), else by strong reference (its ``id`` is then not reused while cached). Bounded:
    entries are added while :attr:`nbytes` (the encoded bytes held) stays within ``max_bytes``
    (parts beyond are encoded every time); :meth:`sweep`, after each checkpoint, drops the
    entries that checkpoint did not use (parts gone from the state)."""

    def __init__(self, max_bytes: int = CHECKPOINT_CACHE_BYTES):
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        #: id(owner) -> (owner or a weak reference to it, refs, fragment, bytes)
        self._entries: dict[int, tuple[object, tuple, orjson.Fragment, int]] = {}
        self._used: set[int] = set()

    def __call__(self, owner: object, refs: tuple, make: Callable[[], Any]) -> orjson.Fragment:
        key = id(owner)
        e = self._entries.get(key)
        if e is not None and _same((e[0], *e[1]), (owner, *refs)):
            self._used.add(key)
            return e[2]
        raw = orjson.dumps(make())
        frag = orjson.Fragment(raw)
        if e is not None:
            del self._entries[key]
            self.nbytes -= e[3]
        if self.nbytes + len(raw) <= self.max_bytes:
            self._entries[key] = (_weak(owner), tuple(map(_weak, refs)), frag, len(raw))
            self.nbytes += len(raw)
            self._used.add(key)
        return frag

    def limit(self, max_bytes: int) -> None:
        """Set :attr:`max_bytes`; entries beyond it are dropped at once."""
        self.max_bytes = int(max_bytes)
        if self.nbytes > self.max_bytes:
            self._entries.clear()
            self._used.clear()
            self.nbytes = 0

    def sweep(self) -> None:
        """Drop the entries not used since the last sweep."""
        for key in [key for key in self._entries if key not in self._used]:
            self.nbytes -= self._entries.pop(key)[3]
        self._used.clear()


def _published_at_of(sizing: Any) -> int | None:
    """The online loop's sample count at the decision that published a map (its
    ``sizing["evidence"]["samples"]``), or None (not published by the online loop)."""
    ev = (sizing or {}).get("evidence") if isinstance(sizing, Mapping) else None
    at = ev.get("samples") if isinstance(ev, Mapping) else None
    return at if isinstance(at, int) and not isinstance(at, bool) else None


def _published_at(data: bytes | None) -> int | None:
    """:func:`_published_at_of` of a map's JSON bytes (None if they do not parse)."""
    if data is None:
        return None
    try:
        return _published_at_of(orjson.loads(data).get("sizing"))
    except (orjson.JSONDecodeError, AttributeError):
        return None


def config_of(epoch: EpochSpec, monitor: MonitorSpec) -> dict[str, Any]:
    """The checkpoint's ``config`` object of two specs (:data:`CONFIG_KEYS`; ``p`` a float)."""
    f = epoch.fit
    return {"eps": f.eps, "p": f.p, "delta": f.delta, "sizing": f.sizing.value,
            "mu_pool": f.mu_pool, "pool": f.pool_size, "variant": f.variant.value,
            "mode": f.mode.value, "prescale": f.prescale_value.value,
            "outside": f.outside_value.value, "holdout": epoch.holdout, "warmup": epoch.warmup,
            **{key: getattr(monitor, key) for key in _MONITOR_KEYS}}


def specs_of(cfg: Mapping[str, Any]) -> tuple[EpochSpec, MonitorSpec]:
    """The two specs of a checkpoint's ``config`` object (every key of :data:`CONFIG_KEYS`;
    ``p`` a number or ``"inf"``): :class:`InputError` for options an epoch cannot run."""
    fit = FitSpec(eps=cfg["eps"], p=cfg["p"], delta=cfg["delta"], sizing=cfg["sizing"],
                  pool_size=cfg["pool"],
                  mu_pool=cfg["mu_pool"], variant=cfg["variant"], mode=cfg["mode"],
                  prescale=cfg["prescale"], outside=cfg["outside"])
    epoch = EpochSpec(fit, holdout=cfg["holdout"], warmup=cfg["warmup"])
    return epoch, MonitorSpec(**{key: cfg[key] for key in _MONITOR_KEYS})


@dataclass
class IngestResult:
    """What one :meth:`ModelState.offer` / :meth:`ModelState.ingest` call did."""

    joined: int = 0                      # samples added to pools and monitor
    sampled_out: int = 0                 # events dropped by the sample rate, before the join
    label_out_of_range: int = 0          # joined samples dropped: label >= k
    evicted: dict[str, int] = field(default_factory=dict)
    unmatched: dict[str, int] = field(default_factory=dict)
    sealed: int = 0                      # epochs sealed (pools became full) by this call
    sealed_early: int = 0                # of which sealed before full, at the byte budget
    window_trimmed: int = 0              # samples dropped from the window by its byte budget
    #: online mode: the calibrator's events (lpcal.online.Event), in order
    events: list[Event] = field(default_factory=list)
    #: online mode: the stream waits at the sample where a requested fit takes effect
    blocked: bool = False
    #: online mode: versions the calibrator published again in a replay that the bin-map topic
    #: already holds (:meth:`ModelState.adopt_published`): installed, not to be sent again
    on_topic: set[int] = field(default_factory=set)

    @property
    def pools_full(self) -> bool:
        return self.sealed > 0

    @property
    def published(self) -> list[BinMap]:
        """Online mode: maps the calibrator published (already installed) that the topic does
        not hold yet: publish them."""
        return [e.binmap for e in self.events
                if e.kind == "published" and e.version not in self.on_topic]

    @property
    def fit_requests(self) -> list[FitRequest]:
        """Online mode: fits to run (:func:`lpcal.online.run_fit`, off the event loop), then
        hand back with :meth:`ModelState.complete_fit`."""
        return [e.request for e in self.events if e.request is not None]


#: what :meth:`ModelState.check_triggers` passes the triggers when the drift condition cannot
#: hold (no calibrated window to evaluate)
_NO_STATS: Mapping[str, WindowStats | None] = {}

#: joined samples up to which :meth:`ModelState.ingest` checks the labels as a list
_SMALL_CHECK = 64

#: ``k = 0``: a model whose ``k`` is learned from its first prediction, created by outcomes that
#: arrived first. Its join buffer holds them; its (empty) pools and monitor
#: are built for this placeholder until :meth:`ModelState.offer` learns ``k``.
_PROVISIONAL_K = 2


class ModelState:
    """Per-model pools, monitor, join buffer, triggers, bin map, epoch and offsets."""

    def __init__(self, model: str, k: int, epoch_spec: EpochSpec, monitor_spec: MonitorSpec,
                 layout: PoolLayout, join: JoinStore, *, monitor: WindowMonitor | None = None,
                 triggers: Triggers | None = None,
                 calibrator_factory: CalibratorFactory = binmap_calibrator,
                 eval_interval: float = 1.0, online_spec: OnlineSpec | None = None):
        self.model = model
        self.k = int(k)
        #: how the epochs are filled and fitted (:class:`daemon.specs.EpochSpec`)
        self.epoch_spec = epoch_spec
        #: the window, drift trigger and change test (:class:`daemon.specs.MonitorSpec`)
        self.monitor_spec = monitor_spec
        self.lam = epoch_spec.lam
        kk = self.k or _PROVISIONAL_K
        if layout.k != kk or layout.lam != self.lam:
            raise InputError(f"model {model!r}: layout has (k, lambda) = ({layout.k}, "
                             f"{layout.lam}), expected ({kk}, {self.lam})")
        self.layout = layout
        self.filling = PoolSet(layout)        # receives the joined samples
        self.fill_epoch = 0                    # epoch number of ``filling``
        self.sealed: list[tuple[int, PoolSet]] = []  # full epochs, oldest first
        self.join = join
        self.monitor = monitor or self._new_monitor(kk)
        change = monitor_spec.change_detector()
        if self.monitor.change is None or (self.monitor.change.settings()[:3]
                                           != change.settings()[:3]):
            # a new monitor, one restored from before the change test, or new test settings:
            # the test starts its baseline with the next calibrated samples
            self.monitor.set_change(change)
        self.triggers = triggers or Triggers(monitor_spec.drift_trigger())
        self.binmap: bytes | None = None
        self.binmap_version = 0
        #: the online loop's sample count when the live map was published (None: not its map)
        self._live_at: int | None = None
        self.offsets: dict[str, dict[int, int]] = {}
        self.samples_total = 0
        self.dropped_labels = 0
        self._factory = calibrator_factory
        self._calibrator: Calibrator | None = None
        self.eval_interval = float(eval_interval)
        #: (time, calibrated window stats) of the triggers' last evaluation
        self._last_eval: tuple[float, WindowStats | None] | None = None
        #: share of the events kept (see the module docstring); set from the model settings
        self.sample_rate = 1.0
        #: largest ``ts_limit`` of the batches offered so far (record timestamp + allowed skew):
        #: no clock of this state may be beyond it (see :meth:`bound_clocks`)
        self.ts_limit = -math.inf
        self.clocks_repaired = 0
        #: byte budget of the pools, held-out sums and window (None: none; see
        #: :meth:`set_budget`)
        self.budget: int | None = None
        #: how the model recovers (:class:`daemon.specs.OnlineSpec`)
        self.online_spec = online_spec or OnlineSpec()
        #: online mode: the calibrator (None in epochs mode, or until k is known)
        self.online: OnlineCalibrator | None = None
        #: online mode: joined samples the blocked calibrator has not consumed yet, in order:
        #: ``(probs, labels, routing uniforms, ts or None)``
        self.backlog: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None = None
        #: online mode, after a restore: the newest map of the bin-map topic, newer than this
        #: state's, that the replay is expected to publish again (:meth:`adopt_published`):
        #: ``(its bytes, the map, the calibrator's sample count it was published at)``; not
        #: checkpointed (the next restore reads the topic again)
        self.adopting: tuple[bytes, BinMap, int] | None = None
        if self.online_spec.online and self.k:
            self.online = self._new_online()

    @classmethod
    def create(cls, model: str, k: int, ms: Any, join: Any, *,
               calibrator_factory: CalibratorFactory = binmap_calibrator) -> ModelState:
        """New state from model settings ``ms`` (a ModelSettings: its ``epoch_spec()`` and
        ``monitor_spec()``) and join settings ``join``."""
        try:
            epoch, mon = ms.epoch_spec(), ms.monitor_spec()
            layout = epoch.layout(k or _PROVISIONAL_K)
        except InputError as e:
            raise InputError(f"model {model!r}: {e}") from None
        store = JoinStore(join.max_pending_per_model, join.ttl_seconds,
                          getattr(join, "recent_per_model", None))
        online = ms.online_spec() if hasattr(ms, "online_spec") else None
        st = cls(model, k, epoch, mon, layout, store, calibrator_factory=calibrator_factory,
                 online_spec=online)
        st.sample_rate = float(getattr(ms, "sample_rate", 1.0))
        return st

    # ---------------------------------------------------------------- sampling
    def sample(self, mb: Any) -> tuple[Any, int]:
        """``(the events of mb kept by the sample rate, how many were dropped)``: an event is
        kept iff ``route_uniform([id]) < sample_rate``. The reference of the daemon's raw-bytes
        prefilter (``daemon._speedups.sample_out``), which drops a subset of these same events
        before parsing."""
        rate = self.sample_rate
        if rate >= 1.0 or not len(mb):
            return mb, 0
        keep = route_uniform_fast(mb.ids) < rate
        dropped = int(keep.size - np.count_nonzero(keep))
        return (mb if dropped == 0 else mb.select(keep)), dropped

    # ---------------------------------------------------------------- ingest
    def offer(self, mb: Any, now: float | None = None) -> IngestResult:
        """Join a :class:`daemon.events.ModelBatch` of this model and ingest what it completes."""
        if mb.model != self.model:
            raise InputError(f"batch of model {mb.model!r} offered to {self.model!r}")
        if self.k == 0 and mb.k:
            self._learn_k(mb.k)
        if mb.k not in (0, self.k):
            raise InputError(f"model {self.model!r}: batch has k={mb.k}, state has k={self.k}")
        lim = getattr(mb, "ts_limit", math.inf)
        if lim < math.inf:
            if lim > self.ts_limit:
                self.ts_limit = float(lim)
            self.bound_clocks(self.ts_limit)
        mb, dropped = self.sample(mb)
        if not len(mb):
            return IngestResult(sampled_out=dropped)
        jr: JoinResult = self.join.offer(self.model, mb.kind, mb.ids, mb.ts,
                                         mb.probs if mb.k else None, mb.labels, now)
        res = self.ingest(jr.ids, jr.probs, jr.labels, jr.ts)
        res.evicted, res.unmatched = jr.evicted, jr.unmatched
        res.sampled_out = dropped
        return res

    def _learn_k(self, k: int) -> None:
        """The first batch with vectors of a model created with ``k = 0`` (its outcomes came
        first): build the pools and the monitor for ``k``; the join buffer, with the outcomes
        that wait for their predictions, the triggers, offsets and counters are kept."""
        self.k = int(k)
        self.layout = self.epoch_spec.layout(self.k)
        self.filling = PoolSet(self.layout)
        self.sealed = []
        self.monitor = self._new_monitor(self.k, max_bytes=self._monitor_budget())
        self._last_eval = None
        if self.online_spec.online:
            self.online = self._new_online()

    def _new_online(self) -> OnlineCalibrator:
        """A fresh calibrator for this state's k, fit spec and byte budget, whose live map (the
        champion) is the state's bin map, if any, with its version."""
        cal = OnlineCalibrator(self.k, self.online_spec.config(self.fit_spec,
                                                               self._online_budget()),
                               model_id=self.model)
        cal.install(None if self.binmap is None else BinMap.from_json(self.binmap),
                    self.binmap_version)
        return cal

    def _new_monitor(self, k: int, max_bytes: int | None = None) -> WindowMonitor:
        """An empty window for ``k`` classes, with the monitor spec's size and change test."""
        mon = self.monitor_spec
        return WindowMonitor(k, self.lam, self.fit_spec.p, window_samples=mon.window_samples,
                             window_seconds=mon.window_seconds, max_bytes=max_bytes,
                             change=mon.change_detector())

    @property
    def fit_spec(self) -> FitSpec:
        """The options of this model's fits (:func:`lpcal.calibrate.fit_pools`)."""
        return self.epoch_spec.fit

    def bound_clocks(self, limit: float) -> bool:
        """Pull the event-time clocks (join watermark and TTL deadlines, monitor window, drift
        timers) back to at most ``limit``. The parser rejects events more than the allowed skew
        after their record timestamp (``ts_out_of_range``), so beyond the largest record
        timestamp seen plus that skew a clock can only be poisoned: carried by a checkpoint
        written before the bound. Repaired at the first batch after the
        restore; counted in ``clocks_repaired``. Returns whether anything was beyond."""
        hit = self.join.bound_clock(limit)
        hit = self.monitor.bound_clock(limit) or hit
        hit = self.triggers.drift.bound_clock(limit) or hit
        if hit:
            self.clocks_repaired += 1
        return hit

    def ingest(self, ids: list[str], probs: np.ndarray, labels: np.ndarray,
               ts: np.ndarray | None = None) -> IngestResult:
        """Add joined samples: route to pools (sealing epochs at their exact fill point), update
        the monitors (raw and, with a bin map, calibrated). Samples with ``label >= k`` (possible
        when an outcome arrived before the model's ``k`` was known) are dropped and counted.
        With ``sample_rate < 1``, samples are routed with ``u / sample_rate`` (see the module
        docstring); ids outside the sample (only possible when called directly, not through
        :meth:`offer`) are dropped silently."""
        labels = np.asarray(labels, dtype=np.int64)
        res = IngestResult()
        n = labels.shape[0]
        if n == 0:
            return res
        probs = np.asarray(probs, dtype=np.float64).reshape(n, self.k)
        u = route_uniform_fast(ids)
        rate = self.sample_rate
        if rate < 1.0:
            ok = (labels >= 0) & (labels < self.k) & (u < rate)
            u = u / rate
            all_ok = bool(ok.all())
        elif n <= _SMALL_CHECK:  # a few labels: checked as Python ints (a NumPy reduction
            ok = None           # costs more than the list)
            lab = labels.tolist()
            all_ok = min(lab) >= 0 and max(lab) < self.k
        else:
            ok = None
            all_ok = bool(labels.min() >= 0) and bool(labels.max() < self.k)
        if not all_ok:
            if ok is None:
                ok = (labels >= 0) & (labels < self.k)
            keep = np.flatnonzero(ok)
            bad = (labels < 0) | (labels >= self.k)
            res.label_out_of_range = int(np.count_nonzero(bad))
            self.dropped_labels += res.label_out_of_range
            ids = [ids[i] for i in keep.tolist()]
            probs, labels, u = probs[keep], labels[keep], u[keep]
            ts = None if ts is None else np.asarray(ts)[keep]
        if labels.size and self.online is not None:
            self._ingest_online(res, probs, labels, u, ts)
        elif labels.size:
            c, h, pair = bin_rows(probs, self.lam)  # shared by the pools and the monitor
            # pools full already (e.g. after a layout change): add_samples takes nothing and
            # the loop seals them first
            a, n = 0, labels.size
            while a < n:
                # the warm-up grid and the held-out sums are exact integers, so batching does
                # not change them: a replay after a crash fits the same temperature to the bit
                if a:
                    used = self.filling.add_samples(u[a:], probs[a:], labels[a:],
                                                    raw_bins=(c[a:], h[a:]))
                else:  # the whole batch (the common case): the arrays, not five views of them
                    used = self.filling.add_samples(u, probs, labels, raw_bins=(c, h))
                a += used
                if self.filling.full:
                    self.seal()
                    res.sealed += 1
                elif self._epoch_over_budget():  # all of the batch was taken (a == n)
                    self.seal()
                    res.sealed += 1
                    res.sealed_early += 1
                elif a < n:  # not full, yet not every sample was taken: cannot happen
                    raise RuntimeError(f"model {self.model!r}: pools consumed {used} of "
                                       f"{n - a + used} samples without filling")
            cal = self._calibrator(probs) if self._calibrator is not None else None
            before = self.monitor.trimmed
            self.monitor.update(probs, labels, ts, calibrated=cal, hashes=(h, pair))
            res.window_trimmed = self.monitor.trimmed - before
        res.joined = int(labels.size)
        self.samples_total += res.joined
        return res

    # ---------------------------------------------------------------- online mode
    def _ingest_online(self, res: IngestResult, probs: np.ndarray, labels: np.ndarray,
                       u: np.ndarray, ts: np.ndarray | None) -> None:
        """Feed the calibrator (after any backlog, in order); what it does not consume (it
        blocked) joins the backlog."""
        if self.backlog is not None:
            bp, bl, bu, bts = self.backlog
            self.backlog = None
            if bts is not None or ts is not None:
                bts = np.full(bl.size, np.nan) if bts is None else bts
                ts = np.concatenate([bts, np.full(labels.size, np.nan) if ts is None
                                     else np.asarray(ts, dtype=np.float64)])
            probs, labels, u = (np.concatenate([bp, probs]), np.concatenate([bl, labels]),
                                np.concatenate([bu, u]))
        self._feed_online(res, probs, labels, u, ts)

    def _feed_online(self, res: IngestResult, probs: np.ndarray, labels: np.ndarray,
                     u: np.ndarray, ts: np.ndarray | None) -> None:
        cal = self.online
        start = cal.n_seen
        up = cal.update(probs, labels, uniforms=u)
        m = up.consumed
        ts_in = None if ts is None else np.asarray(ts)
        if m == labels.size:  # all consumed (not blocked): the arrays, not views of them
            self._take_events(res, up.events, start, probs, labels, ts_in)
        else:
            self._take_events(res, up.events, start, probs[:m], labels[:m],
                              None if ts_in is None else ts_in[:m])
        if m < labels.size:
            self.backlog = (probs[m:].copy(), labels[m:].copy(), u[m:].copy(),
                            None if ts is None else np.asarray(ts, dtype=np.float64)[m:])
        res.blocked = cal.blocked

    def _take_events(self, res: IngestResult, events: list[Event], start: int,
                     probs: np.ndarray, labels: np.ndarray, ts: np.ndarray | None) -> None:
        """Update the monitor with the consumed samples, installing each published map at the
        exact sample it was published (the calibrated window restarts there); while a newer
        map of the topic is expected (:meth:`adopt_published`), the replayed versions up to
        it are installed but marked ``on_topic``."""
        before = self.monitor.trimmed
        if not events:  # the common case: no map published within these samples
            self._monitor_rows(probs, labels, ts)
            if self.adopting is not None and self.online.n_seen >= self.adopting[2]:
                self._adopt_now()
            res.window_trimmed += self.monitor.trimmed - before
            return
        a = 0
        for e in events:
            if e.kind == "published":
                b = e.n - start
                self._monitor_rows(probs[a:b], labels[a:b], None if ts is None else ts[a:b])
                a = b
                if self.adopting is not None and e.version <= self.adopting[1].version:
                    res.on_topic.add(e.version)
                    if e.version == self.adopting[1].version:
                        self._replayed(e.binmap)
                        continue
                self._use_binmap(e.binmap.to_json(), e.version,
                                 same_regime=self._same_regime(e.binmap))
        self._monitor_rows(probs[a:], labels[a:], None if ts is None else ts[a:])
        if self.adopting is not None and self.online.n_seen >= self.adopting[2]:
            self._adopt_now()  # the replay went past the topic's map without publishing it
        res.window_trimmed += self.monitor.trimmed - before
        res.events.extend(events)

    # ---------------------------------------------------------------- adoption after a restore
    def adopt_published(self, data: bytes, binmap: BinMap, *, replay: bool) -> bool:
        """A restore found ``binmap`` (``data``, its bytes on the bin-map topic) newer than this
        state's map: a crash between publishing and checkpointing. Returns True when the
        adoption is deferred to the replay, False when the map is installed now.

        Online mode, ``replay`` (the state is the checkpoint's, unchanged by the settings) and
        the map carries the calibrator's sample count it was published at, beyond this state's:
        the replay from the checkpoint's offsets makes the same decisions and publishes the
        same maps, so the adoption waits for it. The replayed versions up to the topic's are
        installed and not sent again (``IngestResult.on_topic``); when the replay publishes
        the topic's version with the same content (up to ``created_at``) the topic's bytes
        are installed, and the run continues exactly as the uninterrupted one. If the replay
        diverges (it publishes other content under that version, or passes the sample count
        without publishing it: input that is not replayed in the same order), the topic's map
        is installed then as the live map (the champion/challenger tests restart against it).
        Either way no version at or below the topic's is published again: versions only go
        up.

        Otherwise (epochs mode, a state reconciled with new settings, a map without a sample
        count) the map is installed now (:meth:`install_binmap`)."""
        if binmap.version <= self.binmap_version:
            return False
        evidence = (binmap.sizing or {}).get("evidence") or {}
        at = evidence.get("samples", (binmap.sizing or {}).get("samples"))
        if (replay and self.online is not None and isinstance(at, int)
                and at > self.online.n_seen):
            self.adopting = (bytes(data), binmap, at)
            return True
        self.adopting = (bytes(data), binmap, 0)
        self._adopt_now()
        return False

    def _replayed(self, bm: BinMap) -> None:
        """The replay published the topic's version: the same map (up to ``created_at``)
        installs the topic's bytes and keeps the calibrator as it is; another map is a
        divergence (:meth:`_adopt_now`)."""
        data, topic, _ = self.adopting
        if (dataclasses.replace(bm, created_at=topic.created_at).to_json()
                == dataclasses.replace(topic).to_json()):
            self.adopting = None
            # the loop published this very map
            self._use_binmap(data, topic.version, same_regime=self._same_regime(topic))
        else:
            self._adopt_now()

    def _adopt_now(self) -> None:
        """Install the expected topic map as the live map (the calibrator's champion)."""
        data, topic, _ = self.adopting
        self.adopting = None
        self.install_binmap(data, topic.version)
        if self.online is not None:
            self.online.install(topic, topic.version)

    def _monitor_rows(self, probs: np.ndarray, labels: np.ndarray,
                      ts: np.ndarray | None) -> None:
        if labels.size:
            cal = self._calibrator(probs) if self._calibrator is not None else None
            self.monitor.update(probs, labels, ts, calibrated=cal)

    def complete_fit(self, request: FitRequest, binmap: BinMap | None) -> IngestResult:
        """Online mode: hand back a fit request's result (:func:`lpcal.online.run_fit`; None
        if it raised: the request is done without a candidate, logged by the caller). If
        the calibrator was blocked on it, the decision that waited runs and the backlog is fed
        (it may block again on the next request): the result says what happened."""
        if self.online is None:
            raise InputError(f"model {self.model!r}: complete_fit needs recovery = 'online'")
        res = IngestResult()
        start = self.online.n_seen
        events = self.online.complete(request, binmap)
        self._take_events(res, events, start, np.zeros((0, self.k)), np.zeros(0, np.int64),
                          None)
        if self.backlog is not None and not self.online.blocked:
            probs, labels, u, ts = self.backlog
            self.backlog = None
            self._feed_online(res, probs, labels, u, ts)
        res.blocked = self.online.blocked
        return res

    def feed_backlog(self) -> IngestResult:
        """Online mode: feed the backlog if the calibrator is no longer blocked (after
        :meth:`notify_drift` dropped the fit it was blocked on); what happened, as
        :meth:`complete_fit` says it."""
        res = IngestResult()
        if self.online is not None and self.backlog is not None and not self.online.blocked:
            probs, labels, u, ts = self.backlog
            self.backlog = None
            self._feed_online(res, probs, labels, u, ts)
        res.blocked = self.online is not None and self.online.blocked
        return res

    @property
    def fit_requests_outstanding(self) -> list[FitRequest]:
        """Online mode: fit requests whose result is not back (after a restore: run them)."""
        return [] if self.online is None else self.online.outstanding

    def notify_drift(self) -> Event | None:
        """The drift trigger's refill: online mode, only post-drift buckets count from now on
        (:meth:`lpcal.online.OnlineCalibrator.notify_drift`; the live map stays until beaten);
        epochs mode, :meth:`start_new_epoch`."""
        if self.online is None:
            self.start_new_epoch()
            return None
        return self.online.notify_drift()

    def respond_online(self, firing: Firing) -> str:
        """Online mode: act on a trigger firing; returns ``"window_reset"`` or ``"fit_requested"``.

        * A drift the **change test** declared (``cause == "change"``): the data changed, so
          only post-drift buckets count (:meth:`notify_drift`); the trigger stays disarmed until
          the next map.
        * The **absolute threshold** (the live map's windowed Err_p lower bound above
          ``drift_threshold``): the map is not good enough, which says nothing about when the
          data changed; throwing the window away would only delay the repair. The next decision
          point fits (:meth:`request_fit`; champion/challenger decides) and the trigger is
          re-armed at once, so the change test keeps watching while no new map comes.
        * A **manual** request: :meth:`request_fit`."""
        if firing.action == "refill" and self.triggers.drift.cause != "threshold":
            self.notify_drift()
            return "window_reset"
        self.request_fit()
        if firing.action == "refill":
            self.triggers.drift.rearm()
        return "fit_requested"

    def request_fit(self) -> list[Event]:
        """Online mode: a manual request (:meth:`lpcal.online.OnlineCalibrator.request_fit`):
        the next decision point fits; champion/challenger decides what is published."""
        if self.online is None:
            raise InputError(f"model {self.model!r}: request_fit needs recovery = 'online'")
        return self.online.request_fit()

    # ---------------------------------------------------------------- lifecycle
    def advance_offsets(self, topic: str, partition: int, next_offset: int) -> None:
        """Record that input up to ``next_offset`` (exclusive) of ``topic[partition]`` is in."""
        parts = self.offsets.setdefault(topic, {})
        if next_offset > parts.get(int(partition), -1):
            parts[int(partition)] = int(next_offset)

    def evaluate(self) -> dict[str, WindowStats | None]:
        """Window metrics of both predictors, at the drift confidence ``z``."""
        return self.monitor.evaluate(self.monitor_spec.drift_confidence)

    def check_triggers(self, now: float, *, busy: bool = False,
                       stats: Mapping[str, WindowStats | None] | None = None,
                       lazy: bool = False) -> Firing | None:
        """Ask the triggers what to do at ``now`` (evaluates the monitor's calibrated predictor
        unless ``stats``).

        ``pools_full`` is "a sealed epoch is waiting to be fitted". Evaluating the window costs
        O(window bins * k), so it is redone at most every ``eval_interval`` seconds of ``now``
        (the drift trigger works at the scale of ``drift_sustain_seconds``); cheap to call per
        batch. With ``lazy``, not at all while the drift condition cannot hold, which decides
        the same: without a bin map (no calibrated window) or with fewer samples in the window
        than the trigger's ``min_samples`` (the condition asks for at least that many
        calibrated samples, and the calibrated window holds at most the raw window's)."""
        if stats is None and lazy and (self._calibrator is None or sum(
                bk.n for bk in self.monitor.buckets.values()) < self.triggers.drift.min_samples):
            stats = _NO_STATS
        if stats is not None:
            calibrated = stats.get("calibrated")
        else:  # the triggers read the calibrated predictor only
            last = self._last_eval
            if last is not None and 0.0 <= now - last[0] < self.eval_interval:
                calibrated = last[1]
            else:
                calibrated = self.monitor.evaluate_one("calibrated",
                                                       self.monitor_spec.drift_confidence)
                self._last_eval = (now, calibrated)
        ready = (not self.online.warming if self.online is not None
                 else bool(self.sealed) or not self.filling.warming)
        return self.triggers.check(now=now, pools_full=bool(self.sealed),
                                   manual_ready=ready, stats=calibrated, busy=busy,
                                   change=self.change_alarm)

    @property
    def change_alarm(self) -> bool:
        """The change test's alarm on the live bin map (latched until the next map)."""
        return self.monitor.change is not None and self.monitor.change.alarm

    @property
    def pools(self) -> PoolSet:
        """The pools to fit next: the oldest sealed (full) epoch, else the filling one."""
        return self.sealed[0][1] if self.sealed else self.filling

    def pool_fill(self) -> dict[str, tuple[int, int]] | None:
        """``{pool: (samples, target)}`` of the pools to fit next (``lpcal_pool_samples``,
        ``lpcal_pool_fill_ratio``); None in online mode: its sliding window has no target to
        fill (the loop publishes at any time), and the empty epoch pools would read as pools
        that stopped filling (``LpcalPoolsNotFilling``)."""
        return None if self.online_spec.online else self.pools.fill()

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
        """True while :data:`MAX_SEALED` or more sealed epochs wait for their fit, or while they
        take a quarter of the byte budget or more (:mod:`daemon.state_budget`): stop feeding
        this model until fits catch up (one batch may seal several epochs, so the queue can
        exceed the mark by what one batch holds). Online mode: true while the calibrator is
        blocked on a fit or joined samples wait in the backlog."""
        if self.online_spec.online:
            return self.backlog is not None or (self.online is not None
                                                and self.online.blocked)
        if len(self.sealed) >= MAX_SEALED:
            return True
        return (self.budget is not None and bool(self.sealed)
                and sum(ps.nbytes for _, ps in self.sealed) >= SEALED_SHARE * self.budget)

    # ---------------------------------------------------------------- byte budget
    def _monitor_budget(self) -> int | None:
        return None if self.budget is None else int(MONITOR_SHARE * self.budget)

    def _epoch_budget(self) -> int | None:
        return None if self.budget is None else int(EPOCH_SHARE * self.budget)

    def _online_budget(self) -> int | None:
        """Online mode: the calibrator's window gets the epochs' and the sealed epochs' parts
        (it has neither)."""
        return None if self.budget is None else int((EPOCH_SHARE + SEALED_SHARE) * self.budget)

    def set_budget(self, budget: int | None) -> int:
        """Set the byte budget of the pools, held-out sums and monitoring window (None: none;
        split as :mod:`daemon.state_budget` describes); the window is trimmed to its part at
        once. Returns the samples trimmed from the window."""
        self.budget = None if budget is None else int(budget)
        if self.online is not None:
            self.online.set_max_bytes(self._online_budget())
        return self.monitor.set_max_bytes(self._monitor_budget())

    def _epoch_over_budget(self) -> bool:
        """True when the filling epoch, compacted, takes more than its part of the budget."""
        limit = self._epoch_budget()
        if limit is None or self.filling.nbytes <= limit:
            return False
        self.filling.compact()  # buffered rows are dense: count the epoch as it will be kept
        return self.filling.nbytes > limit

    @property
    def nbytes(self) -> int:
        """Bytes of the pools (filling and sealed epochs), held-out sums, window sums and the
        checkpoint cache (the join buffer has its own budget:
        :meth:`daemon.join.JoinStore.memory_bytes`)."""
        online = 0 if self.online is None else self.online.nbytes
        if self.backlog is not None:
            online += sum(a.nbytes for a in self.backlog if a is not None)
        return (self.filling.nbytes + sum(ps.nbytes for _, ps in self.sealed)
                + self.monitor.nbytes + online + self.checkpoint_cache_bytes)

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
        """Use this bin map from now on: the calibrated window restarts, drift is rearmed.
        Online mode: a map installed from outside the loop becomes its champion (the tests
        against the live map restart)."""
        self._use_binmap(data, version)
        if self.online is not None and self.online.version != self.binmap_version:
            self.online.install(BinMap.from_json(self.binmap), self.binmap_version)

    def _use_binmap(self, data: bytes, version: int, *, same_regime: bool = False) -> None:
        """:meth:`install_binmap` without telling the online loop: for the maps it published
        itself (:meth:`_take_events`). When one call publishes several, the loop is already
        past the earlier ones, and installing them into it would reset its tests and its
        record of the live map in a way that depends on batching.

        ``same_regime`` (:meth:`_same_regime`): the map replaces one the loop published in the
        same regime (no drift notified between them: a refinement, a corrected map, a
        re-certified copy). The change test then keeps its baseline and its CUSUM: restarting
        it at every such map would leave it blind while the online loop publishes often (a
        new 5,000-sample baseline each time), and a refinement published just after a drift
        began would take its baseline on drifted samples, hiding the drift for good. Only the
        first map, a map after a drift and a map from outside the loop re-measure it."""
        self._calibrator = self._factory(bytes(data))
        self.binmap = bytes(data)
        self.binmap_version = int(version)
        self._live_at = _published_at(self.binmap)
        self.monitor.reset("calibrated", keep_change=same_regime)
        self.triggers.recalibrated()
        self._last_eval = None

    def use_published_bytes(self, version: int, data: bytes) -> bool:
        """The bytes of live map ``version`` as published (signed): the online loop installs
        its maps unsigned at the sample it decides, the daemon signs them when it sends them.
        Replaces the installed bytes if ``version`` is still the live one (True), so that what
        this state serves and checkpoints is the topic's artifact; the map (and so the
        calibrator, the monitor and the change test) is the same."""
        if self.binmap_version != int(version) or self.binmap is None:
            return False
        self.binmap = bytes(data)
        return True

    def _same_regime(self, bm: BinMap) -> bool:
        """True when ``bm``, published by the online loop, replaces a live map the loop
        published since the current regime began (the last drift notification): both carry
        the loop's sample count at their decision (``sizing["evidence"]["samples"]``)."""
        if self.online is None or self.binmap is None:
            return False
        live_at = self._live_at
        new_at = _published_at_of(bm.sizing)
        start = self.online.regime_start
        return live_at is not None and new_at is not None and start <= live_at <= new_at

    @property
    def calibrator(self) -> Calibrator | None:
        return self._calibrator

    # ---------------------------------------------------------------- checkpoint
    def to_dict(self) -> dict[str, Any]:
        """The state as the JSON document of ``lpcal.model_state/3`` (epochs) or /4 (online):
        what :meth:`to_checkpoint` wrote before /5, count tables as bin keys and integer lists
        (:meth:`from_dict` reads it; kept for comparisons and for checkpoints an older daemon
        must read)."""
        return self._document(packed=False, memo=None)

    def to_checkpoint(self) -> bytes:
        """The whole state as one orjson document (key: the model id), in
        :data:`PACKED_CHECKPOINT_FORMAT`: :meth:`to_dict`'s document with packed count
        tables, monitor sums and loss grids; parts unchanged since the last call come from
        :attr:`checkpoint_cache`."""
        cache = self.checkpoint_cache
        cache.limit(CHECKPOINT_CACHE_BYTES if self.budget is None
                    else min(CHECKPOINT_CACHE_BYTES, self.budget // 4))
        try:
            return orjson.dumps(self._packed_dict(cache))
        finally:
            cache.sweep()

    @property
    def checkpoint_cache(self) -> CheckpointCache:
        """The encoded parts kept between checkpoints (counted in :attr:`nbytes`)."""
        cache = self.__dict__.get("_checkpoint_cache")
        if cache is None:
            cache = self._checkpoint_cache = CheckpointCache()
        return cache

    @property
    def checkpoint_cache_bytes(self) -> int:
        cache = self.__dict__.get("_checkpoint_cache")
        return 0 if cache is None else cache.nbytes

    def _packed_dict(self, memo: CheckpointCache) -> dict[str, Any]:
        """:meth:`to_dict` in :data:`PACKED_CHECKPOINT_FORMAT`, its parts through ``memo``."""
        return self._document(packed=True, memo=memo)

    def _document(self, *, packed: bool, memo: CheckpointCache | None) -> dict[str, Any]:
        """The checkpoint document: /6 with ``packed`` (count tables, monitor sums and loss
        grids as packed arrays, the parts unchanged since the last checkpoint from ``memo``),
        else /3 or /4."""
        def keep(owner: object, refs: tuple, make: Callable[[], Any]) -> Any:
            return make() if memo is None else memo(owner, refs, make)

        def config() -> dict[str, Any]:
            cfg = config_of(self.epoch_spec, self.monitor_spec)
            cfg["p"] = "inf" if math.isinf(cfg["p"]) else cfg["p"]
            return cfg

        online = self.online_spec.online
        binmap = self.binmap
        d = {
            "format": (PACKED_CHECKPOINT_FORMAT if packed
                       else ONLINE_CHECKPOINT_FORMAT if online else CHECKPOINT_FORMAT),
            "model": self.model,
            "k": self.k,
            "config": keep(self.epoch_spec, (self.monitor_spec,), config),
            "fill_epoch": self.fill_epoch,
            "filling": self.filling.to_dict(packed=packed, memo=memo),
            "sealed": [{"epoch": e,
                        "pools": keep(ps, (), lambda ps=ps: ps.to_dict(packed=packed))}
                       for e, ps in self.sealed],
            "monitor": self.monitor.to_dict(memo=memo, packed=packed),
            "join": self.join.to_dict(),
            "triggers": self.triggers.to_dict(),
            "binmap": None if binmap is None else keep(binmap, (),
                                                       lambda: binmap.decode("utf-8")),
            "binmap_version": self.binmap_version,
            "offsets": {t: {str(p): o for p, o in sorted(parts.items())}
                        for t, parts in sorted(self.offsets.items())},
            "samples_total": self.samples_total,
            "dropped_labels": self.dropped_labels,
            "ts_limit": None if math.isinf(self.ts_limit) else self.ts_limit,
        }
        if online:
            d["recovery"] = keep(self.online_spec, (), self.online_spec.to_dict)
            d["online"] = (None if self.online is None
                           else self.online.to_dict(packed=packed, memo=memo))
            d["backlog"] = None if self.backlog is None else _encode_backlog(self.backlog)
        return d

    @classmethod
    def from_checkpoint(cls, data: bytes, *,
                        calibrator_factory: CalibratorFactory = binmap_calibrator
                        ) -> ModelState:
        """Validate and restore a checkpoint; raise :class:`ArtifactError` naming the problem."""
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ArtifactError(f"checkpoint is not valid JSON: {e}") from None
        return cls.from_dict(d, calibrator_factory=calibrator_factory)

    @classmethod
    def from_dict(cls, d: Any, *,
                  calibrator_factory: CalibratorFactory = binmap_calibrator) -> ModelState:
        """:meth:`from_checkpoint` of a decoded checkpoint (the ``state`` of the daemon's
        envelope, decoded once with it)."""
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
            part = "config"
            cfg = dict(d["config"])
            if "mode" not in cfg:  # written before the certified mode: it ran the paper's
                for key, value in _LEGACY_CONFIG.items():
                    cfg.setdefault(key, value)
            for key, value in _CHANGE_CONFIG.items():  # written before the change test
                cfg.setdefault(key, value)
            missing = [key for key in CONFIG_KEYS if key not in cfg]
            if missing:
                raise ValueError(f"config lacks {missing}")
            epoch, mon = specs_of(cfg)
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
            part = "recovery"
            has_online = fmt == ONLINE_CHECKPOINT_FORMAT or (
                fmt in (PACKED_5_CHECKPOINT_FORMAT, PACKED_CHECKPOINT_FORMAT)
                and "recovery" in d)
            online = OnlineSpec(**dict(d["recovery"])) if has_online else None
            if online is not None and not online.online:
                raise ValueError("the recovery of a checkpoint with one is online")
            part = "header"
            st = cls(model, k, epoch, mon, pools.layout, join, monitor=monitor,
                     triggers=triggers, calibrator_factory=calibrator_factory,
                     online_spec=online)
            st.filling = pools
            for e, ps in sealed:
                if (ps.layout.k, ps.layout.lam) != (k or _PROVISIONAL_K, st.lam):
                    raise ValueError(f"sealed epoch {e} has (k, lambda) = "
                                     f"({ps.layout.k}, {ps.layout.lam})")
            st.sealed = sealed
            if (monitor.k, monitor.lam) != (k or _PROVISIONAL_K, st.lam):
                raise ValueError(f"monitor has (k, lambda) = ({monitor.k}, {monitor.lam})")
            st.fill_epoch = int(d["fill_epoch"])
            st.samples_total = int(d["samples_total"])
            st.dropped_labels = int(d["dropped_labels"])
            # absent (older checkpoints): learnt from the first batch, which then repairs
            # clocks poisoned by a far-future event
            tl = d.get("ts_limit")
            st.ts_limit = -math.inf if tl is None else float(tl)
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
                st._live_at = _published_at(st.binmap)
            st.binmap_version = int(d["binmap_version"])
            if online is not None:
                part = "online"
                if d["online"] is not None:
                    st.online = OnlineCalibrator.from_dict(d["online"])
                    if (st.online.k, st.online.model_id) != (k, model):
                        raise ValueError(f"calibrator of (k, model) = ({st.online.k}, "
                                         f"{st.online.model_id!r})")
                    if not online.accepts(st.online.config, st.fit_spec):
                        raise ValueError("the calibrator's settings do not match the "
                                         "checkpoint's recovery and fit settings")
                elif k:
                    raise ValueError("no calibrator for a state with k")
                part = "backlog"
                st.backlog = None if d["backlog"] is None else _decode_backlog(d["backlog"], k)
        except (InputError, ArtifactError) as e:
            raise ArtifactError(f"{where}: {part}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"{where}: {part}: malformed ({type(e).__name__}: {e})") from None
        return st

    def reconcile(self, ms: Any, join: Any, k: int | None = None
                  ) -> tuple[ModelState, str, str]:
        """Bring a restored state in line with the current settings:
        ``(state, outcome, detail)`` with outcome ``restored`` (nothing changed: ``self``),
        ``k_changed`` or ``config_changed`` (a new state; the caller drops any fit in flight).

        * ``k`` (the settings' pinned k; None: learned, keep the state's) differs: the pools,
          sealed epochs, join buffer, monitor, triggers and bin map are discarded (none of them
          applies to another k); the offsets covered, the bin-map version counter (so later
          versions stay above those published) and the sample counters are kept, and the
          next epoch starts.
        * the :class:`daemon.specs.EpochSpec` differs (eps, p and so lambda, delta, pool sizes,
          mode, held-out share, warm-up, ...): a new epoch starts with the new spec and
          layout; the filling and sealed pools are discarded. The join buffer is kept (same
          k); the monitor and the bin map are kept only if lambda is unchanged.
        * only the :class:`daemon.specs.MonitorSpec` differs: it takes effect (a new window
          when a field of :data:`MonitorSpec.WINDOW` changed, new triggers and change test
          when one of :data:`MonitorSpec.DRIFT` did).

        * ``recovery`` or an online knob (:class:`daemon.specs.OnlineSpec`) differs: a
          switch between ``epochs`` and ``online`` starts a new epoch (fresh pools) and, to
          online, a fresh calibrator; the live bin map and its version are kept (the
          calibrator's champion). A changed knob of an online state starts a fresh calibrator
          with the live map.

        ``detail`` names every changed setting with its old and new value.

        Raises :class:`InputError` for settings an epoch cannot run."""
        epoch_spec, mon = ms.epoch_spec(), ms.monitor_spec()
        if self.k == 0 and k:  # k pinned since: learn it, keeping the waiting outcomes
            self._learn_k(int(k))
        want_k = self.k if not k else int(k)
        online = ms.online_spec() if hasattr(ms, "online_spec") else OnlineSpec()
        old_cfg, cfg = config_of(self.epoch_spec, self.monitor_spec), config_of(epoch_spec, mon)
        old_cfg.update(self.online_spec.to_dict())
        cfg.update(online.to_dict())
        changed = [key for key in cfg if old_cfg[key] != cfg[key]]
        if (want_k == self.k and epoch_spec == self.epoch_spec and mon == self.monitor_spec
                and online == self.online_spec):
            return self, "restored", ""
        keep_online = False
        if want_k != self.k:
            new_join = JoinStore(join.max_pending_per_model, join.ttl_seconds,
                                 getattr(join, "recent_per_model", None))
            st = ModelState(self.model, want_k, epoch_spec, mon, epoch_spec.layout(want_k),
                            new_join, calibrator_factory=self._factory,
                            eval_interval=self.eval_interval, online_spec=online)
            outcome = "k_changed"
            detail = f"k {self.k} -> {want_k}" + (f"; {', '.join(changed)} changed"
                                                    if changed else "")
        else:
            lam = epoch_spec.lam
            same_lam = lam == self.lam
            window = same_lam and mon.same(self.monitor_spec, MonitorSpec.WINDOW)
            drift = mon.same(self.monitor_spec, MonitorSpec.DRIFT)
            epoch = (epoch_spec != self.epoch_spec
                     or online.recovery != self.online_spec.recovery)
            layout = epoch_spec.layout(self.k) if epoch else self.layout
            st = ModelState(self.model, self.k, epoch_spec, mon, layout, self.join,
                            monitor=self.monitor if window else None,
                            triggers=self.triggers if drift else None,
                            calibrator_factory=self._factory, eval_interval=self.eval_interval,
                            online_spec=online)
            if not epoch:
                st.filling, st.sealed, st.fill_epoch = self.filling, self.sealed, self.fill_epoch
            keep_online = not epoch and online == self.online_spec
            if keep_online:
                st.online, st.backlog = self.online, self.backlog
            if same_lam and self.binmap is not None:
                st.binmap, st._calibrator = self.binmap, self._calibrator
            outcome = "config_changed"
            detail = ", ".join(f"{key} {old_cfg[key]!r} -> {cfg[key]!r}" for key in changed)
            if epoch:
                detail += "; a new epoch starts"
            if not same_lam:
                detail += f"; lambda {self.lam} -> {lam}: window and bin map discarded"
        if st.filling is not self.filling:
            st.fill_epoch = self.fill_epoch + len(self.sealed) + 1
        st.binmap_version = self.binmap_version
        if st.online_spec.online and st.k and not keep_online:
            st.online = st._new_online()  # its champion: the live map, with its version
        st.offsets = {t: dict(parts) for t, parts in self.offsets.items()}
        st.samples_total, st.dropped_labels = self.samples_total, self.dropped_labels
        st.sample_rate = self.sample_rate
        st.ts_limit = self.ts_limit
        return st, outcome, detail

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelState):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (f"ModelState(model={self.model!r}, k={self.k}, epoch={self.fill_epoch}, "
                f"filling={self.filling.total}, sealed={len(self.sealed)}, "
                f"pending={self.join.pending()}, "
                f"binmap_version={self.binmap_version})")
