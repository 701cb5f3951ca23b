"""The models a replica owns: one :class:`ModelSlot` per model in a :class:`ModelRegistry`.

A slot holds everything the daemon keeps about one model besides the input positions: its
:class:`~daemon.model_state.ModelState`, the input partition it lives on, the fit in flight, the
count of prefitted epochs (see
:meth:`daemon.checkpoint.restorer.Restorer.adopt_published_binmaps`), the latest event time
seen and the time its gauges were last exported. Three marks are kept as sets of model ids, since
they are work lists the daemon walks: ``dirty`` (changed since its last checkpoint, walked by
the checkpoints), ``touched`` (given events or a request since the last batch's trigger checks)
and ``waiting`` (with sealed epochs waiting for their fit, or backlogged); after each batch the triggers of
``touched | waiting`` are asked, so per-batch work follows the models a batch touched, not
the number of models.

Models come and go only through the registry's operations, which keep the join budget, the
parser and the per-model metrics in step (after aiokafka's ``TopicPartitionState``: the state
of one unit of assignment in one object, its operations next to it):

* :meth:`ModelRegistry.create`: a model seen for the first time (its first event), or whose
  state record could not be used: its versions start at the latest verified version on the
  bin-map topic (``published``, the replica's :class:`daemon.binmap_view.BinMapView`), whose
  map it installs when its k and lambda fit, so a lost state never makes versions go back;
* :meth:`ModelRegistry.restore`: a model restored from its checkpoint record;
* :meth:`ModelRegistry.release`: the models of revoked partitions, dropped, or parked in memory
  when their checkpoint failed; :meth:`ModelRegistry.unpark` reinstates them if their
  partitions come back and the parked state is further along than the checkpoint restored.

The byte budgets' per-model shares follow a planned model count
(:class:`daemon.state_budget.BudgetShares`): ``create`` gives the new model the current shares,
and ``create`` and ``release`` walk every model (:meth:`ModelRegistry.rebudget`) only when the
shares change, O(1) amortised per admission or release; ``restore`` and ``unpark`` run for many
models at once, and the restore (:class:`daemon.checkpoint.restorer.Restorer`) rebudgets once
after them. What the daemon keeps
per input partition (positions, sample rates) is in :mod:`daemon.partitions`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from daemon.model_state import ModelState
from daemon.state_budget import BudgetShares
from lpcal.pools import PoolSet

log = logging.getLogger("lpcal.daemon")


@dataclass
class Inflight:
    """A fit started from an epoch's frozen pools; checkpointed until its bin map is published."""

    pools: PoolSet
    trigger: str
    version: int
    task: asyncio.Future | None = None


@dataclass(eq=False)
class ModelSlot:
    """One owned model: its state and the daemon's bookkeeping about it."""

    state: ModelState
    partition: int
    inflight: Inflight | None = None
    prefitted: int = 0  # sealed epochs to come whose bin maps were already published
    gauges_at: float = 0.0  # time.monotonic() of its last window evaluation for its gauges
    #: that evaluation (a :class:`daemon.gauges.WindowGauges`), or None
    window_gauges: Any = None
    event_time: float | None = None  # the latest event time seen (None: no event yet)

    def covered(self) -> int:
        """Sum of the input offsets its state covers (a parked state further along wins)."""
        return sum(o for t in self.state.offsets.values() for o in t.values())


class ModelInfo(NamedTuple):
    """A read-only view of one owned model (:meth:`ModelRegistry.snapshot`, the HTTP API)."""

    model: str
    state: ModelState
    partition: int
    fit_in_flight: bool


class ModelRegistry:
    """The owned models, their slots and the operations that add and remove them."""

    def __init__(self, settings, metrics, parser):
        self.s, self.metrics, self.parser = settings, metrics, parser
        self.slots: dict[str, ModelSlot] = {}
        self.dirty: set[str] = set()    # changed since their last checkpoint
        self.touched: set[str] = set()  # events or a request since the last trigger checks
        self.waiting: set[str] = set()  # sealed epochs waiting for their fit, or backlogged
        #: the per-model shares of the byte budgets (join buffers; pools and windows)
        self.shares = BudgetShares.from_settings(settings.join, settings.state)
        # slots of revoked partitions whose checkpoint failed (broker down): model -> slot
        self.parked: dict[str, ModelSlot] = {}
        #: ``published(model)``: the latest verified bin map of ``model`` on the bin-map topic
        #: (a :class:`daemon.binmap_view.Served`) or None; set by the daemon
        self.published = None
        #: counts the operations that put a state in place of another or remove one (restore,
        #: reinstate, release, place): what a reader caching facts about the slots (their
        #: partition, sample rate, restored offsets: :class:`daemon.ingest.Ingest`) checks
        self.generation = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, model: object) -> bool:
        return model in self.slots

    def get(self, model: str) -> ModelSlot | None:
        return self.slots.get(model)

    def on_partitions(self, parts: set[int]) -> list[str]:
        """The models of input partitions ``parts``."""
        return [m for m, slot in self.slots.items() if slot.partition in parts]

    def snapshot(self) -> list[ModelInfo]:
        """The owned models, sorted by id (read-only; for the HTTP API)."""
        return [ModelInfo(m, slot.state, slot.partition, slot.inflight is not None)
                for m, slot in sorted(self.slots.items())]

    def info(self, model: str) -> ModelInfo | None:
        """One owned model (read-only; for the HTTP API), or None."""
        slot = self.slots.get(model)
        return None if slot is None else ModelInfo(model, slot.state, slot.partition,
                                                   slot.inflight is not None)

    def follow_served(self, model: str, st: ModelState, served) -> None:
        """Let ``st`` continue after ``served``, a verified map of the bin-map topic
        (:class:`daemon.binmap_view.Served`): installed when its k and lambda fit the state,
        else (not applicable to this model, or k still to be learned) its version only."""
        if (served.bm.k, served.bm.lam) == (st.k, st.lam):
            st.install_binmap(served.raw, served.version)
        else:
            st.binmap_version = served.version
        self.dirty.add(model)

    # ------------------------------------------------------------------ operations
    def create(self, model: str, k: int, partition: int) -> ModelState:
        """A model seen for the first time, or whose state was lost, on input ``partition``:
        its first version follows the latest verified one published (see the module
        docstring)."""
        st = ModelState.create(model, int(k), self.s.model_settings(model), self.s.join)
        if model in self.slots:
            self.generation += 1
        self.slots[model] = ModelSlot(st, partition)
        self.metrics.register_model(model)
        served = None if self.published is None else self.published(model)
        if served is not None and served.version > st.binmap_version:
            self.follow_served(model, st, served)
            self.metrics.set_binmap_published(model, served.version)
            log.info("model %s: no state; versions continue after version %d, the latest "
                     "verified bin map on the topic%s", model, served.version,
                     "" if st.binmap is not None else " (not applied: its k or lambda differs)")
        if self.shares.set_count(len(self.slots)):
            self.rebudget()  # the shares changed: every model's
        else:
            self._budget_one(model, self.slots[model], *self.shares.shares())
        return st

    def restore(self, model: str, st: ModelState, partition: int, *, sample_rate: float,
                inflight: Inflight | None, prefitted: int, dirty: bool) -> ModelSlot:
        """A model restored from its checkpoint (admitted even beyond ``max_models``); call
        :meth:`rebudget` after restoring a set of models."""
        slot = self.slots[model] = ModelSlot(st, partition, inflight, prefitted)
        self.generation += 1
        self.parser.admit(model, st.k)
        self.metrics.register_model(model, restored=True)
        st.sample_rate = sample_rate
        if dirty:
            self.dirty.add(model)
        self.mark_waiting(model, st)
        return slot

    def unpark(self, parts: set[int]) -> None:
        """Reinstate parked slots of re-assigned partitions when they are further along than
        the checkpoint restored (or there is none): their covered offsets decide."""
        for model, slot in list(self.parked.items()):
            if slot.partition not in parts:
                continue
            del self.parked[model]
            cur = self.slots.get(model)
            if cur is not None and cur.covered() >= slot.covered():
                continue
            self.slots[model] = slot
            self.generation += 1
            self.parser.admit(model, slot.state.k)
            self.metrics.register_model(model, restored=True)
            self.dirty.add(model)
            self.mark_waiting(model, slot.state)
            log.info("model %s: reinstated the state kept in memory (its checkpoint failed)",
                     model)

    def release(self, parts: set[int], *, park: bool) -> None:
        """Remove the models of revoked partitions ``parts`` (cancelling their fits); with
        ``park``, keep their slots to reinstate if the partitions come back (:meth:`unpark`).
        The caller offers their staged events first (:meth:`daemon.ingest.Ingest.flush_staged`)."""
        self.generation += 1
        for model in self.on_partitions(parts):
            slot = self.slots.pop(model)
            inf = slot.inflight
            if inf is not None and inf.task is not None:
                inf.task.cancel()
            if park:  # on reassignment, the state further along wins
                slot.inflight = None if inf is None else Inflight(inf.pools, inf.trigger,
                                                                  inf.version)
                slot.gauges_at, slot.window_gauges = 0.0, None
                self.parked[model] = slot
            self.dirty.discard(model)
            self.touched.discard(model)
            self.waiting.discard(model)
            self.metrics.remove_model(model)
        if self.shares.set_count(len(self.slots)):
            self.rebudget()

    def place(self, model: str, st: ModelState, partition: int) -> ModelSlot:
        """Put a prepared state in place on input ``partition`` without metrics or budgets
        (tests and tools; the daemon itself uses :meth:`create` and :meth:`restore`)."""
        self.generation += 1
        slot = self.slots.get(model)
        if slot is None:
            slot = self.slots[model] = ModelSlot(st, partition)
        else:
            slot.state, slot.partition = st, partition
        self.mark_waiting(model, st)
        return slot

    def mark_waiting(self, model: str, st: ModelState) -> None:
        """Keep ``model`` in ``waiting`` while it has sealed epochs waiting for their fit or is
        backlogged (online mode: a calibrator blocked on a fit), else drop it."""
        if st.sealed or st.backlogged:
            self.waiting.add(model)
        else:
            self.waiting.discard(model)

    def fitting(self) -> dict[str, Inflight]:
        """``{model: fit in flight}`` (a copy)."""
        return {m: slot.inflight for m, slot in self.slots.items() if slot.inflight is not None}

    def states(self) -> dict[str, ModelState]:
        """``{model: state}`` of the owned models (a copy)."""
        return {m: slot.state for m, slot in self.slots.items()}

    def rebudget(self) -> None:
        """Give every model its shares of the replica's byte budgets (:attr:`shares`, a
        :class:`daemon.state_budget.BudgetShares` set to the number of models): of the join
        buffers, at most ``join.max_bytes_per_model``, and of the pools and monitoring windows,
        at most ``state.max_bytes_per_model``, with ``models * share`` never above the totals.
        A lowered budget evicts the oldest pending events of a model at once (counted as
        ``capacity`` evictions) and trims its window (counted). O(models): :meth:`create` and
        :meth:`release` call it only when the shares change; call it after restoring a set of
        models."""
        self.shares.set_count(len(self.slots))
        share, state_share = self.shares.shares()
        total = models = trimmed = 0
        for model, slot in self.slots.items():
            evicted, cut = self._budget_one(model, slot, share, state_share)
            self.mark_waiting(model, slot.state)  # a lowered budget can backlog it
            if evicted:
                total += evicted
                models += 1
            trimmed += cut
        if total:  # one line per change of the share, not one per model
            log.info("join buffer budget now %d bytes per model (%d models): evicted the %d "
                     "oldest pending events of %d models", share, len(self.slots), total,
                     models)
        if trimmed:
            log.info("state budget now %d bytes per model (%d models): trimmed %d samples "
                     "from monitoring windows", state_share, len(self.slots), trimmed)

    def _budget_one(self, model: str, slot: ModelSlot, share: int,
                    state_share: int) -> tuple[int, int]:
        """Give ``model`` the byte budgets ``share`` (join buffer) and ``state_share`` (pools
        and window); ``(events evicted, window samples trimmed)``, both counted."""
        st = slot.state
        evicted = cut = 0
        if st.join.max_bytes != share:
            evicted = st.join.set_budget(share)
            if evicted:
                self.metrics.inc_evicted(model, "capacity", evicted)
        if st.budget != state_share:
            cut = st.set_budget(state_share)
            if cut:
                self.metrics.inc_window_trimmed(model, cut)
        return evicted, cut
