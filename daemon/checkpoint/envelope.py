"""The checkpoint records' codec: model records (:data:`ENVELOPE_FORMAT`) and partition
manifests, encoded and decoded here only.

* ``model/<id>``: one model's envelope: ``{"format", "model", "partition", "state",
  "inflight", "prefitted", "saved_at"}``; ``state`` is the model's
  :meth:`~daemon.model_state.ModelState.to_checkpoint`, ``inflight`` the frozen pools of a fit
  in flight (:meth:`lpcal.pools.PoolSet.to_dict`, packed since ``lpcal.model_state/5``,
  without its empty tables since /6; every form is read), ``saved_at`` the wall-clock time of the snapshot (absent in envelopes of earlier
  versions);
* ``partition/<n>``: ``{"offsets": {topic: next offset}, "models": [...]}``.

Decoding returns an :class:`Envelope` (or the offsets of a manifest), or a :class:`Rejected`
whose ``reason`` is the outcome counted in ``lpcal_state_restores_total``: ``too_large`` (the
value is, or inflates to, more than the limit), ``corrupt`` (unreadable),
``wrong_model`` (the record holds another model's state), ``bad_manifest``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from daemon.checkpoint.store import ValueTooLarge, decode_value
from daemon.model_state import ModelState
from daemon.registry import Inflight, ModelSlot
from lpcal.errors import ArtifactError
from lpcal.pools import PoolSet

ENVELOPE_FORMAT = "lpcal.envelope/1"


class Rejected(NamedTuple):
    """A record that cannot be used: the restore outcome it counts as, and why."""

    reason: str
    detail: str


@dataclass
class Envelope:
    """A decoded model record."""

    model: str
    partition: int
    state: ModelState
    inflight: Inflight | None
    prefitted: int
    saved_at: float | None  # None: unknown (the record's own time stands in for it)


def encode_envelope(model: str, slot: ModelSlot) -> bytes:
    """The checkpoint record of ``model``: its state, partition, fit in flight, prefitted
    count and ``saved_at``, the wall-clock time of this snapshot. The restore compares bin
    maps on the topic with ``saved_at``, not with the record's time: a map published while
    the snapshot was being written came after it."""
    inf, st = slot.inflight, slot.state
    state = orjson.Fragment(st.to_checkpoint())
    return orjson.dumps({
        "format": ENVELOPE_FORMAT,
        "model": model,
        "partition": slot.partition,
        "state": state,
        "inflight": None if inf is None else {
            # frozen while the fit runs: packed once, kept in the state's checkpoint cache
            "pools": st.checkpoint_cache(inf.pools, (),
                                         lambda: inf.pools.to_dict(packed=True)),
            "trigger": inf.trigger, "version": inf.version},
        "prefitted": slot.prefitted,
        "saved_at": time.time(),
    })


def decode_envelope(model: str, raw: bytes, *, limit: int,
                    wanted: Callable[[int], bool]) -> Envelope | Rejected | None:
    """The envelope of ``model`` in ``raw`` (maybe compressed; inflated within ``limit``
    bytes), or why it cannot be used; None when ``wanted(partition)`` is false (a record of
    another partition: its state is not decoded)."""
    try:
        value = decode_value(raw, limit)
    except ValueTooLarge as e:
        return Rejected("too_large", str(e))
    except ValueError as e:
        return Rejected("corrupt", str(e))
    try:
        env = orjson.loads(value)
        del value
        if not isinstance(env, dict):
            raise ArtifactError(f"envelope is a JSON {type(env).__name__}, not an object")
        if env.get("format") != ENVELOPE_FORMAT:
            raise ArtifactError(f"format {env.get('format')!r}")
        part = env.get("partition")
        if type(part) is not int:
            raise ArtifactError(f"partition {part!r} is not an integer")
        if not wanted(part):
            return None
        owner = env.get("model", model)
        st = ModelState.from_dict(env["state"])  # decoded once, with its envelope
        if owner != model or st.model != model:
            return Rejected("wrong_model", st.model if st.model != model else owner)
        saved_at = env.get("saved_at")  # absent in envelopes of earlier versions
        if not (type(saved_at) in (int, float) and math.isfinite(saved_at)):
            saved_at = None  # unknown: the record's timestamp stands in for it
        prefitted = env.get("prefitted") or 0
        if type(prefitted) is not int or not 0 <= prefitted <= 1_000_000:
            raise ArtifactError(f"prefitted {prefitted!r}")
        inf = env.get("inflight")
        inflight = None
        if inf:
            inflight = Inflight(PoolSet.from_dict(inf["pools"]), str(inf["trigger"]),
                                int(inf["version"]))
    except Exception as e:  # noqa: BLE001 - any bad record costs its model only
        return Rejected("corrupt", f"{type(e).__name__}: {e}")
    return Envelope(model, part, st, inflight, prefitted, saved_at)


def encode_manifest(offsets: dict[str, int], models: Iterable[str]) -> bytes:
    """The manifest of one input partition: its input offsets and models."""
    return orjson.dumps({"offsets": offsets, "models": sorted(models)})


def decode_manifest(raw: bytes, topics: Iterable[str], *, limit: int
                    ) -> dict[str, int] | Rejected:
    """``{topic: offset}`` of the ``topics`` a manifest records, or why it cannot be used
    (``too_large``, ``bad_manifest``)."""
    try:
        m = orjson.loads(decode_value(raw, limit))
        if not isinstance(m, dict) or not isinstance(m.get("offsets"), dict):
            raise TypeError("not an object with an 'offsets' object")
        offsets = {}
        for topic in topics:
            off = m["offsets"].get(topic)
            if off is None:
                continue
            if type(off) is not int or off < 0:
                raise ValueError(f"offset of {topic!r} is {off!r}, not an integer >= 0")
            offsets[topic] = off
    except ValueTooLarge as e:
        return Rejected("too_large", str(e))
    except (TypeError, ValueError, orjson.JSONDecodeError) as e:
        return Rejected("bad_manifest", str(e))
    return offsets
