"""Benchmark: the cost of a model's checkpoint, ``lpcal.model_state/6`` against the unpacked
format (/3, /4).

What a replica holding many models spends at every checkpoint (``state.checkpoint_interval``)
is the encoding of every model that changed since the last one. The **baseline** is the
encoder of the unpacked format, run in the same process on the same state:
``orjson.dumps(state.to_dict())``, exactly what ``ModelState.to_checkpoint`` was before /5
(bin keys and integer lists for the count tables, one base64 string per monitor array;
``to_dict`` still writes that document).
A generic serializer (``pickle``) is not the honest peer: a checkpoint must be read by another
version and validated as hostile input, which pickle cannot do safely (and the state holds
locks it cannot pickle).

States (one model each; ``ModelState`` with the default model settings and join settings,
``k = 10`` and ``k = 100``; samples of :class:`tests.bench.common.Overconfident` with 200
prototypes for half of the rows, ingested in batches of 1,000 as the daemon feeds joined
samples, then predictions waiting for their outcomes in the join buffer, 2,000 or 50 in the
small states):

* **epochs**: the default recovery: 60,000 samples, so one epoch sealed and fitted (its bin
  map is live) and the next one filling;
* **online**: online recovery: 60,000 samples, fits run when the calibrator asks (maps
  published, a window of sealed buckets);
* **small**: epochs, 500 samples: what each model of the many-models benchmark holds (the
  fixed cost per model);
* **few**: epochs and online, 200 samples, 20 more per repetition, 10 predictions waiting:
  each model of a replica holding thousands of models, at a checkpoint (the fixed cost per
  model at its smallest).

Per state, each repetition first ingests one more batch of 200 samples (20 in the few-sample
states; untimed: the model is dirty, as it is at a checkpoint while data flows), then times,
back to back, the baseline encoder, the /6 encoder (``to_checkpoint``: parts unchanged since the
last checkpoint come from the model's cache) and the /6 encoder without its cache (every part
encoded). Decoding (``ModelState.from_checkpoint``, validation included) of the two documents is
timed the same way. Reported: medians over the repetitions, the median per-repetition ratio
/6 : baseline, the
bytes of each document and the bytes the Kafka store writes (its zstd level 1 above 64 KiB,
:func:`daemon.checkpoint.store.encode_value`), and the bytes the cache holds.

Run alone: ``python -m tests.bench.bench_checkpoint [--quick]``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import numpy as np
import orjson

from daemon.checkpoint.store import encode_value
from daemon.event_records import ModelPolicy
from daemon.events import EventParser
from daemon.model_state import CheckpointCache, ModelState
from daemon.settings import JoinSettings, ModelSettings
from lpcal.online import run_fit
from tests.bench.common import Overconfident, Table, fmt_num

REPEATS = 7
QUICK_REPEATS = 3
BATCH = 1_000
STEP = 200          # samples ingested before each repetition
#: ... in the few-sample states (a model of many, at one checkpoint interval)
FEW_STEP = 20
#: predictions waiting in the join buffer (their outcomes follow later)
PENDING = {"epochs": 2_000, "online": 2_000, "small": 50, "few": 10, "few online": 10}
SAMPLES = {"epochs": 60_000, "online": 60_000, "small": 500, "few": 200, "few online": 200}
QUICK_SAMPLES = {"epochs": 6_000, "online": 6_000, "small": 500, "few": 200,
                 "few online": 200}
#: the kinds measured, in the tables' order
KINDS = ("few", "few online", "small", "epochs", "online")


def step_of(kind: str) -> int:
    """Samples ingested before each repetition of ``kind``."""
    return FEW_STEP if kind.startswith("few") else STEP


class Feed:
    """A state and the stream of joined samples it is fed (ids, probabilities, labels)."""

    def __init__(self, kind: str, k: int, n: int, seed: int = 0, pending: int = 0):
        recovery = "online" if kind.endswith("online") else "epochs"
        self.state = ModelState.create("bench", k, ModelSettings(recovery=recovery, k=k),
                                       JoinSettings())
        self.task = Overconfident(k, prototypes=200, proto_share=0.5)
        self.k, self.seed, self.at = k, seed, 0
        self.queue: list = []
        self.feed(n)
        self._pending(pending)

    def feed(self, n: int) -> None:
        st = self.state
        f, y, _ = self.task.sample(n, self.seed * 1_000_003 + self.at)
        for a in range(0, n, BATCH):
            b = min(n, a + BATCH)
            ids = [f"e{self.at + i}" for i in range(a, b)]
            res = st.ingest(ids, f[a:b], y[a:b], (self.at + np.arange(a, b)) * 0.01)
            self.queue += res.fit_requests
            while self.queue and st.backlogged:  # online: the fit the stream waits for
                req = self.queue.pop(0)
                self.queue += st.complete_fit(req, run_fit(req)).fit_requests
            while st.sealed:  # epochs: fit the sealed epoch and install its map
                from lpcal.calibrate import fit_pools

                pools = st.pools
                st.start_new_epoch()
                bm = fit_pools(pools, st.fit_spec, model_id=st.model,
                               version=st.binmap_version + 1)
                st.install_binmap(bm.to_json(), bm.version)
        self.at += n

    def _pending(self, n: int) -> None:
        """``n`` predictions whose outcomes have not arrived (through the parser and join)."""
        f, _, _ = self.task.sample(n, self.seed + 77)
        t0 = self.at * 0.01
        msgs = [orjson.dumps({"model": "bench", "id": f"p{i}", "ts": t0 + i * 1e-3,
                              "probs": f[i].tolist()}) for i in range(n)]
        parser = EventParser(lambda m: ModelPolicy(k=self.k))
        for mb in parser.parse_batch(msgs).by_model.values():
            self.state.offer(mb)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(kind: str, k: int, n: int, repeats: int) -> dict:
    feed = Feed(kind, k, n, pending=PENDING[kind])
    st = feed.state
    st.to_checkpoint()  # the checkpoint before: fills the cache
    rows: dict[str, list[float]] = {key: [] for key in
                                    ("enc_old", "enc_new", "enc_cold", "dec_old", "dec_new")}
    ratios: dict[str, list[float]] = {"enc": [], "enc_cold": [], "dec": []}
    old = new = b""
    was = gc.isenabled()
    for _ in range(repeats):
        feed.feed(step_of(kind))
        gc.collect()
        gc.disable()
        try:
            t_old, old = _timed(lambda: orjson.dumps(st.to_dict()))
            t_new, new = _timed(st.to_checkpoint)
            t_cold, cold = _timed(lambda: orjson.dumps(st._packed_dict(CheckpointCache(0))))
            d_old, a = _timed(lambda old=old: ModelState.from_checkpoint(old))
            d_new, b = _timed(lambda new=new: ModelState.from_checkpoint(new))
        finally:
            if was:
                gc.enable()
        assert cold == new and a == b, "the two formats must hold the same state"
        for key, v in zip(rows, (t_old, t_new, t_cold, d_old, d_new)):
            rows[key].append(v)
        ratios["enc"].append(t_new / t_old)
        ratios["enc_cold"].append(t_cold / t_old)
        ratios["dec"].append(d_new / d_old)
    med = {key: statistics.median(v) for key, v in rows.items()}
    med.update({f"r_{key}": statistics.median(v) for key, v in ratios.items()})
    med.update(bytes_old=len(old), bytes_new=len(new), zbytes_old=len(encode_value(old)),
               zbytes_new=len(encode_value(new)), cache=st.checkpoint_cache_bytes,
               samples=st.samples_total, state_bytes=st.nbytes)
    return med


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f}"


def run(quick: bool = False) -> list[Table]:
    repeats = QUICK_REPEATS if quick else REPEATS
    samples = QUICK_SAMPLES if quick else SAMPLES
    enc = Table("Checkpoint encode and decode per model: model_state/6 against the unpacked "
                "format's encoder (same state, same run)",
                ["state", "k", "samples", "encode unpacked (µs)", "encode /6 (µs)",
                 "ratio", "/6 without cache: ratio", "decode unpacked (µs)",
                 "decode /6 (µs)", "ratio"], key="checkpoint_time")
    size = Table("Checkpoint bytes per model", ["state", "k", "unpacked (KiB)", "/6 (KiB)",
                                                "unpacked, as stored (KiB)",
                                                "/6, as stored (KiB)", "cache (KiB)",
                                                "state bytes (KiB)"], key="checkpoint_bytes")
    for kind in KINDS:
        for k in (10, 100):
            m = measure(kind, k, samples[kind], repeats)
            enc.add(kind, k, m["samples"], _us(m["enc_old"]), _us(m["enc_new"]),
                    fmt_num(m["r_enc"]), fmt_num(m["r_enc_cold"]), _us(m["dec_old"]),
                    _us(m["dec_new"]), fmt_num(m["r_dec"]))
            size.add(kind, k, _kib(m["bytes_old"]), _kib(m["bytes_new"]),
                     _kib(m["zbytes_old"]), _kib(m["zbytes_new"]), _kib(m["cache"]),
                     _kib(m["state_bytes"]))
    enc.notes += [
        (f"Medians over {repeats} repetitions; each ingests {STEP} more samples first "
         f"({FEW_STEP} in the few-sample states: the model is dirty, as at a checkpoint while "
         "data flows), then times the baseline (`orjson.dumps(state.to_dict())`, what "
         "`to_checkpoint` was before /5), /6 (`to_checkpoint`, with the parts unchanged since "
         "the previous checkpoint from the model's cache) and /6 with an empty cache, back to "
         "back. Ratios: median of the per-repetition ratios to the baseline (below 1: /6 is "
         "faster). The few-sample rows are the fixed cost per model of a replica holding "
         "thousands of models (k = 10 and 100, 200 samples and more)."),
        ("The baseline runs first, so it also sums the monitor's waiting rows (its encoder "
         "merges each bucket's sums, which /6 writes as held): /6 then finds those merged "
         "sums new and encodes them again; a daemon's /6 checkpoint re-encodes only the sums "
         "added since its last one."),
        "Decode: `ModelState.from_checkpoint` of each document, validation included.",
        (f"States: default model settings; {PENDING['epochs']:,} predictions wait in the join "
         f"buffer ({PENDING['small']} in the small ones, {PENDING['few']} in the few-sample "
         "ones); epochs states hold a fitted live map and a filling epoch, online states "
         "published maps and hold a window of sealed buckets (see the module docstring)."),
    ]
    size.notes += [
        ("As stored: after the Kafka store's zstd (level 1, values of 64 KiB and more). "
         "Cache: encoded parts the model keeps for its next checkpoint (at most 1 MiB, or a "
         "quarter of its byte budget), counted in its state bytes (last column: pools, window "
         "sums, online window and the cache; not the join buffer)."),
    ]
    return [enc, size]


if __name__ == "__main__":
    for t in run("--quick" in sys.argv[1:]):
        print(t.to_markdown())
