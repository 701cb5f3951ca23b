"""Memory of the join state when event ids grow by one digit (see ``test_load_soak.py``).

Replays one k = 10 model's stream through the daemon's pure state machines (parse, join, pools,
monitor; no Kafka), with ids ``load-k10-<n>`` for ``n`` in ``[start, start + events)`` and each
outcome 5000 events after its prediction, and prints, every 50,000 events, the pymalloc arenas
in use (``sys._debugmallocstats``), the resident memory and the size of the join's recent-id
store. Compare a run whose ids cross 10^6 with one whose ids keep their length::

    python -m tests.reliability.id_length_replay 700000 600000    # crosses 1,000,000
    python -m tests.reliability.id_length_replay 1700000 600000   # 7 digits throughout

Measured on 2026-11-26: 26 arenas before the crossing, 34 after (flat from there on); 28
throughout for 7-digit ids.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import orjson

from daemon.events import EventParser
from daemon.model_state import ModelState
from daemon.settings import load_settings

MODEL, K, DELAY, BATCH = "load-k10", 10, 5000, 500


def pymalloc_arenas() -> int:
    """Arenas pymalloc has allocated now (parsed from ``sys._debugmallocstats``)."""
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(w)
        os.close(saved)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    m = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text)
    if m is None:
        raise RuntimeError("no pymalloc statistics (is tracemalloc or PYTHONMALLOC set?)")
    return int(m.group(1).replace(",", ""))


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))


def replay(start: int, events: int, report=print) -> list[tuple[int, int, int, int]]:
    """Run the replay; returns ``(n, arenas, rss MiB, recent ids)`` every 50,000 events."""
    s = load_settings(None, defaults={"k": K, "pool": 400, "mu_pool": 400, "recovery": "epochs"})
    parser = EventParser.from_settings(s)
    rows = np.random.default_rng(0).dirichlet(np.ones(K), size=4096).round(6)
    rows /= rows.sum(1, keepdims=True)
    st = None
    out = []
    for b0 in range(start, start + events, BATCH):
        preds = [orjson.dumps({"model": MODEL, "id": f"{MODEL}-{i}", "ts": i / 1000,
                               "probs": rows[i % 4096].tolist()}) for i in range(b0, b0 + BATCH)]
        outs = [orjson.dumps({"model": MODEL, "id": f"{MODEL}-{i}", "ts": i / 1000 + 5,
                              "label": i % K})
                for i in range(max(start, b0 - DELAY), b0 - DELAY + BATCH)]
        for values in (preds, outs):
            for model, mb in parser.parse_batch(values).by_model.items():
                if st is None:
                    st = ModelState.create(model, K, s.model_settings(model), s.join)
                st.offer(mb)
                st.sealed.clear()  # no fits here: drop full epochs as a fit would
        if (b0 - start) % 50_000 == 0:
            row = (b0, pymalloc_arenas(), rss_mib(), len(st.join._models[MODEL].recent))
            out.append(row)
            report(f"ids from {row[0]}: {row[1]} arenas, RSS {row[2]} MiB, {row[3]} recent ids")
    return out


if __name__ == "__main__":
    replay(int(sys.argv[1]), int(sys.argv[2]))
