"""Input records as aiokafka decodes them, without a ``ConsumerRecord`` per record, many at
once.

aiokafka's fetcher decodes each record of a fetched batch (offset, timestamp, key, value,
headers; in C where it can), then wraps it in a ``ConsumerRecord`` (eleven fields, sizes and a
headers tuple), one Python object per message. The daemon reads four attributes of an input
record (``offset``, ``timestamp``, ``key``, ``value``), all of which the decoded record has
under the same names and with the same values. Wrapping costs about a third of a plain
aiokafka reader's CPU per message: measured through the embedded broker on the 400,000
messages of the models benchmark's 1-model stream, ``getmany`` + ``orjson.loads`` took 5.6 to
6.0 us of CPU per message, 3.5 to 3.9 without the wrapping (4 interleaved pairs).

Past the wrapping, aiokafka still hands the records over one at a time: a Python generator
steps through each record batch (an offset check, the position, a ``yield`` per record) and
``getall`` appends what it yields to a list, checking ``max_records`` per record. For a
:data:`LEAN` consumer, ``getall`` instead takes up to ``max_records`` decoded records of a batch
in one C-level pass (``islice`` over the batch's own iterator, :func:`take_records`), so no
Python code runs per record and, as with the generator, no record is decoded before it is
taken. The per-batch steps are aiokafka's own (CRC check, transaction aborts under
``read_committed``, control batches skipped, records before the fetch offset left out, the
position after a batch at its ``next_offset``). aiokafka's unused generator is closed: left
unstarted it forms a reference cycle with the records object and kept each fetch response's
bytes until a cyclic collection (the memory-bound reliability test's peak RSS rose from about
300 to 420 MiB until it was closed). The ingest section of docs/benchmarks.md measures
``getmany`` alone three ways.

A consumer opts in by taking :data:`LEAN` as its ``value_deserializer``: once :func:`install`
has run, such a consumer gets the decoded records, many at once; every other consumer of
the process (bin-map and state readers, tests, benchmarks' plain reader) gets
``ConsumerRecord`` s one at a time as before. This reaches into aiokafka's internals, so it is
written to degrade, never to break: if the internals it expects are not there (another
aiokafka version), :func:`install` returns False and :data:`LEAN` is an ordinary identity
deserializer, so the consumer gets ``ConsumerRecord`` s with the same values.
``kafka.lean_records = false`` turns it off. ``tests/daemon/test_lean_records.py`` compares
both kinds of record, and what ``getall`` returns, on real record batches, compressed and with
headers.
"""

from __future__ import annotations

import logging
from itertools import islice
from typing import Any

log = logging.getLogger("lpcal.daemon")

__all__ = ["LEAN", "install", "installed", "take_records"]


class _Lean:
    """The opt-in marker: an identity value deserializer (what it is when not installed)."""

    def __call__(self, value):
        return value

    def __repr__(self) -> str:
        return "lean_records.LEAN"


#: the ``value_deserializer`` of a consumer that takes decoded records as they are
LEAN = _Lean()

_state: dict[str, Any] = {"installed": None}
_END = object()  # a record iterator's sentinel: never a record

#: what :func:`install` needs of aiokafka's ``PartitionRecords`` and ``FetchResult``
_RECORDS_NEEDS = ("_consumer_record", "_consume_aborted_up_to", "_contains_abort_marker")
_RECORDS_FIELDS = ("records", "fetch_offset", "value_deserializer", "check_crcs",
                   "isolation_level")
_RESULT_NEEDS = ("getall", "getone", "check_assignment", "has_more", "_update_position")


def installed() -> bool:
    """Whether :func:`install` succeeded in this process."""
    return bool(_state["installed"])


def install() -> bool:
    """Make aiokafka hand :data:`LEAN` consumers their decoded records, many at once
    (idempotent). Returns False, leaving aiokafka untouched, where its internals are not the
    expected ones."""
    if _state["installed"] is not None:
        return _state["installed"]
    try:
        from aiokafka.consumer import fetcher

        records_cls, result_cls = fetcher.PartitionRecords, fetcher.FetchResult
        init_args = records_cls.__init__.__code__.co_varnames
        _state["read_committed"] = fetcher.READ_COMMITTED
        _state["corrupt"] = fetcher.Errors.CorruptRecordException
        missing = [n for n in _RECORDS_NEEDS if not hasattr(records_cls, n)]
        missing += [n for n in _RESULT_NEEDS if not hasattr(result_cls, n)]
        missing += [n for n in _RECORDS_FIELDS if n not in init_args]
    except (ImportError, AttributeError) as e:
        missing = [f"{type(e).__name__}: {e}"]
    if missing:
        log.info("lean input records unavailable (aiokafka lacks %s): using ConsumerRecord",
                 ", ".join(missing))
        _state["installed"] = False
        return False
    wrap, get_one, get_all = (records_cls._consumer_record, result_cls.getone,
                               result_cls.getall)

    def _consumer_record(self, tp, record):
        if getattr(self, "_value_deserializer", None) is LEAN:
            return record
        return wrap(self, tp, record)

    def getall(self, max_records=None):
        pr = self._partition_records
        if getattr(pr, "_value_deserializer", None) is not LEAN:
            return get_all(self, max_records)
        # FetchResult.getall, with the records of a batch taken at once
        if not self.check_assignment(self._topic_partition) or not self.has_more():
            return []
        recs, exhausted = take_records(pr, max_records)
        self._update_position()
        if exhausted:
            self._partition_records = None
        return recs

    def getone(self):
        pr = self._partition_records
        if getattr(pr, "_value_deserializer", None) is not LEAN:
            return get_one(self)
        # FetchResult.getone, from the same cursor as getall
        if not self.check_assignment(self._topic_partition) or not self.has_more():
            return None
        recs, _ = take_records(pr, 1)
        self._update_position()
        if not recs:
            self._partition_records = None
        return recs[0] if recs else None

    for new, old in ((_consumer_record, wrap), (getall, get_all), (getone, get_one)):
        new.__wrapped__ = old
    records_cls._consumer_record = _consumer_record
    result_cls.getall, result_cls.getone = getall, getone
    _state["installed"] = True
    return True


class _Cursor:
    """Where a :data:`LEAN` consumer's ``PartitionRecords`` is: the current batch and its
    record iterator (aiokafka's C iterator: records are decoded as they are taken), and
    whether records before the fetch offset may still come."""

    __slots__ = ("batch", "done", "records", "skipping")

    def __init__(self) -> None:
        self.batch: Any = None
        self.records: Any = None
        self.skipping = False
        self.done = False


def take_records(pr: Any, max_records: int | None = None) -> tuple[list, bool]:
    """Up to ``max_records`` (None: all) of the records of aiokafka's ``PartitionRecords``
    ``pr`` in offset order, as its generator would yield them (records decoded, not wrapped),
    and whether ``pr`` is exhausted; ``pr.next_fetch_offset`` moves as the generator moves it.

    Per batch, aiokafka's steps: the CRC check (a failure raises aiokafka's
    ``CorruptRecordException`` with the position back where this call began, so no record
    handed out by it is skipped: the batch is fetched again), the aborted transactions under
    ``read_committed``, control batches skipped, records before the fetch offset left out;
    after a batch, the position is its ``next_offset`` (a batch whose last records were
    compacted away is not fetched again). The records are taken from the batch's iterator
    in one ``islice`` per call and batch (C-level): no record is decoded before it is taken,
    as with the generator, so a fetch's records are never all decoded at once. As in
    aiokafka's ``getall``, a ``max_records`` below 1 takes one record."""
    cur = getattr(pr, "_lean_cursor", None)
    if cur is None:
        cur = pr._lean_cursor = _Cursor()
        # aiokafka's record generator, created with pr and never run here: closed, it lets go
        # of pr (unstarted, its frame and pr form a cycle that only the cyclic collector
        # frees, with the fetch response's bytes: MBs per fetch)
        gen = getattr(pr, "_records_iterator", None)
        if gen is not None:
            gen.close()
    if cur.done:
        return [], True
    limit = None if max_records is None else max(1, int(max_records))
    start = pr.next_fetch_offset
    out: list = []
    try:
        while True:
            if cur.records is None and not _next_batch(pr, cur):
                cur.done = True
                return out, True
            want = None if limit is None else limit - len(out)
            part = list(islice(cur.records, want))
            got = len(part)
            if cur.skipping and part:  # a batch that began before the fetch offset
                fetch = pr.next_fetch_offset
                if part[0].offset < fetch:
                    part = [r for r in part if r.offset >= fetch]
                cur.skipping = not part
            if part:
                if out:
                    out += part
                else:
                    out = part
                pr.next_fetch_offset = out[-1].offset + 1
            if want is None or got < want:  # every record of the batch taken
                pr.next_fetch_offset = cur.batch.next_offset
                cur.batch = cur.records = None
                continue
            if len(out) >= limit:  # type: ignore[operator]
                return out, False
    except BaseException:
        pr.next_fetch_offset = start
        cur.batch = cur.records = None
        cur.done = True
        raise


def _next_batch(pr: Any, cur: _Cursor) -> bool:
    """Load the next batch of ``pr`` with records to hand out into ``cur`` (aiokafka's
    ``_unpack_records`` per batch); False when no batch is left."""
    records = pr._records
    while records.has_next():
        batch = records.next_batch()
        if pr._check_crcs and not batch.validate_crc():
            raise _state["corrupt"](f"Invalid CRC - {pr._tp}")
        if (pr._isolation_level == _state["read_committed"]
                and batch.producer_id is not None):
            pr._consume_aborted_up_to(batch.base_offset)
            if batch.is_control_batch and pr._contains_abort_marker(batch):
                pr._aborted_producers.discard(batch.producer_id)
            if batch.is_transactional and batch.producer_id in pr._aborted_producers:
                pr.next_fetch_offset = batch.next_offset
                continue
        if batch.is_control_batch:
            pr.next_fetch_offset = batch.next_offset
            continue
        # the batch's own __next__ behind a callable iterator: islice asks its argument for
        # an iterator at every call, and aiokafka's C batch allows __iter__ only once
        cur.batch, cur.records, cur.skipping = batch, iter(iter(batch).__next__, _END), True
        return True
    return False
