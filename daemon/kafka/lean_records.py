"""Input records as aiokafka decodes them, without a ``ConsumerRecord`` per record.

aiokafka's fetcher decodes each record of a fetched batch (offset, timestamp, key, value,
headers; in C where it can), then wraps it in a ``ConsumerRecord`` (eleven fields, sizes and a
headers tuple), one Python object per message. The daemon reads four attributes of an input
record (``offset``, ``timestamp``, ``key``, ``value``), all of which the decoded record has
under the same names and with the same values. Wrapping costs about a third of a plain
aiokafka reader's CPU per message: measured through the embedded broker on the 400,000
messages of the models benchmark's 1-model stream, ``getmany`` + ``orjson.loads`` took 5.6 to
6.0 us of CPU per message, 3.5 to 3.9 without the wrapping (4 interleaved pairs).

A consumer opts in by taking :data:`LEAN` as its ``value_deserializer``: once :func:`install`
has run, aiokafka's ``PartitionRecords._consumer_record`` hands such a consumer the decoded
records as they are; every other consumer of the process (bin-map and state readers, tests,
benchmarks' plain reader) gets ``ConsumerRecord`` s as before. This reaches into aiokafka's
internals, so it is written to degrade, never to break: if the internals it expects are not
there (another aiokafka version), :func:`install` returns False and :data:`LEAN` is an
ordinary identity deserializer, so the consumer gets ``ConsumerRecord`` s with the same values.
``kafka.lean_records = false`` turns it off. ``tests/daemon/test_lean_records.py`` compares
both kinds of record on real record batches, compressed and with headers.
"""

from __future__ import annotations

import logging

log = logging.getLogger("lpcal.daemon")

__all__ = ["LEAN", "install", "installed"]


class _Lean:
    """The opt-in marker: an identity value deserializer (what it is when not installed)."""

    def __call__(self, value):
        return value

    def __repr__(self) -> str:
        return "lean_records.LEAN"


#: the ``value_deserializer`` of a consumer that takes decoded records as they are
LEAN = _Lean()

_state = {"installed": None}


def installed() -> bool:
    """Whether :func:`install` succeeded in this process."""
    return bool(_state["installed"])


def install() -> bool:
    """Make aiokafka hand :data:`LEAN` consumers their decoded records (idempotent). Returns
    False, leaving aiokafka untouched, where its internals are not the expected ones."""
    if _state["installed"] is not None:
        return _state["installed"]
    try:
        from aiokafka.consumer import fetcher

        cls = fetcher.PartitionRecords
        wrap = cls._consumer_record
        init_args = cls.__init__.__code__.co_varnames
    except (ImportError, AttributeError) as e:
        log.info("lean input records unavailable (%s: %s): using ConsumerRecord",
                 type(e).__name__, e)
        _state["installed"] = False
        return False
    if "value_deserializer" not in init_args:
        _state["installed"] = False
        return False

    def _consumer_record(self, tp, record):
        if getattr(self, "_value_deserializer", None) is LEAN:
            return record
        return wrap(self, tp, record)

    _consumer_record.__wrapped__ = wrap
    cls._consumer_record = _consumer_record
    _state["installed"] = True
    return True
