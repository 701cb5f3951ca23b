"""A seeded, structure-aware fuzzer of malformed input events.

:func:`malformed_events` yields ``(key, value, expected_reason)``: each event is a valid event
of the daemon's contract (``daemon.events``) with ONE defect drawn at random from a family,
so the reason the daemon must dead-letter it under is known by construction. Families (and
their reason): truncated JSON, junk, NaN/Infinity literals (``bad_json``); invalid UTF-8
bytes, Latin-1, CP1252, UTF-16 and UTF-32 encodings (``bad_encoding``); wrong JSON types for
every field, labels beyond 64 bits (orjson reads them as floats), non-object events, giant ids
and model names, non-numeric vector entries, both/neither vector fields (``bad_schema``);
unconfigured models (``unknown_model``); vectors of the wrong length including huge arrays (``wrong_length``); arrays or padding over
``max_bytes`` (``oversize``); entries whose sum overflows (``non_finite``); negative entries
(``negative``); sums off 1 by more than the tolerance, or 0 (``not_normalized``, with
``normalize = "reject"``); labels outside ``[0, k)`` (``label_out_of_range``); event times past
2096, beyond any record timestamp plus the allowed skew (``ts_out_of_range``); vectors of
1001 to 1900 classes for :data:`LEARNED_K_MODEL`, whose ``k`` is learned (``k_too_large``).

The daemon must run with ``unknown_models = "reject"``, ``normalize = "reject"``, the models'
``k`` pinned (``models``), :data:`LEARNED_K_MODEL` configured without ``k``, ``max_k`` at its
default (1000) and ``kafka.max_message_bytes = max_bytes``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import numpy as np
import orjson

TS = 1_764_000_000.0
LEARNED_K_MODEL = "bad-learned"  # configured without k: the daemon learns it (never, here)


def _probs(rng: np.random.Generator, k: int) -> list[float]:
    p = rng.dirichlet(np.ones(k))
    p = np.round(p, 6)
    p[np.argmax(p)] += 1.0 - p.sum()
    return [float(x) for x in p]


def _ascii(rng: np.random.Generator, n: int) -> str:
    return "".join(chr(c) for c in rng.integers(97, 123, size=n))


def malformed_events(n: int, models: Mapping[str, int], seed: int, max_bytes: int
                     ) -> Iterator[tuple[bytes, bytes, str]]:
    rng = np.random.default_rng(seed)
    names = list(models)
    families = [f for f in dir(_Families) if not f.startswith("_")]
    for i in range(n):
        model = names[int(rng.integers(len(names)))]
        k = models[model]
        fam = families[int(rng.integers(len(families)))]
        eid = f"bad-{i}-{_ascii(rng, int(rng.integers(1, 12)))}"
        value, reason, key_model = getattr(_Families, fam)(rng, model, k, eid, max_bytes)
        yield (key_model or model).encode("utf-8", "replace"), value, reason


class _Families:
    """Each method returns ``(value bytes, expected reason, key model or None)``."""

    @staticmethod
    def truncated_json(rng, model, k, eid, mb):
        full = orjson.dumps({"model": model, "id": eid, "ts": TS, "probs": _probs(rng, k)})
        return full[:int(rng.integers(1, len(full) - 1))], "bad_json", None

    @staticmethod
    def junk(rng, model, k, eid, mb):
        pieces = ["{", "}", "[", "]", ":", ",", '"', "nul", "tru", "0x1F", "'a'", "{{", "=",
                  "// c", "\\u12", "1e", "--1", ".5"]
        s = "".join(pieces[int(j)] for j in rng.integers(len(pieces), size=int(rng.integers(1, 9))))
        try:
            orjson.loads(s)
            s = "{" + s  # valid by chance (e.g. "[]"): make it invalid
        except orjson.JSONDecodeError:
            pass
        return s.encode(), "bad_json", None

    @staticmethod
    def nan_literal(rng, model, k, eid, mb):
        p = [str(x) for x in _probs(rng, k)]
        p[int(rng.integers(k))] = ["NaN", "Infinity", "-Infinity", "nan"][int(rng.integers(4))]
        return (f'{{"model":"{model}","id":"{eid}","ts":{TS},"probs":[{",".join(p)}]}}'
                .encode(), "bad_json", None)

    @staticmethod
    def label_beyond_64_bits(rng, model, k, eid, mb):
        big = str(2 ** int(rng.integers(65, 200)))  # orjson reads it as a float: not an int
        return (f'{{"model":"{model}","id":"{eid}","ts":{TS},"label":{big}}}'.encode(),
                "bad_schema", None)

    @staticmethod
    def invalid_utf8(rng, model, k, eid, mb):
        bad = [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80"]
        raw = orjson.dumps({"model": model, "id": eid, "ts": TS, "probs": _probs(rng, k)})
        at = raw.index(eid.encode()) + int(rng.integers(len(eid)))
        return raw[:at] + bad[int(rng.integers(len(bad)))] + raw[at:], "bad_encoding", None

    @staticmethod
    def wrong_encoding(rng, model, k, eid, mb):
        d = {"model": model, "id": eid + "-\u00e9\u00e8", "ts": TS, "probs": _probs(rng, k)}
        text = json.dumps(d, ensure_ascii=False)
        enc = ["latin-1", "utf-16", "utf-16-le", "utf-32", "cp1252"][int(rng.integers(5))]
        return text.encode(enc), "bad_encoding", None

    @staticmethod
    def wrong_types(rng, model, k, eid, mb):
        d = {"model": model, "id": eid, "ts": TS, "probs": _probs(rng, k)}
        if rng.random() < 0.3:
            d = {"model": model, "id": eid, "ts": TS, "label": int(rng.integers(k))}
        field = ["model", "id", "ts", "vector", "label"][int(rng.integers(5))]
        wrong = [None, 1, 2.5, True, [], {}, "x", [1, 2]]
        pick = wrong[int(rng.integers(len(wrong)))]
        if field == "model":
            d["model"] = pick if not isinstance(pick, str) else 7
        elif field == "id":
            d["id"] = pick if not isinstance(pick, str) else 0
        elif field == "ts":  # a missing/None ts falls back to the record time: not a defect
            d["ts"] = ["1764000000", True, [], {}, "now"][int(rng.integers(5))]
        elif field == "vector":
            d.pop("label", None)
            d["probs"] = ["0.5,0.5", {"0": 1.0}, 3, True][int(rng.integers(4))]
        else:
            d.pop("probs", None)
            d["label"] = [1.0, "1", True, [1], {"y": 1}][int(rng.integers(5))]
        return orjson.dumps(d), "bad_schema", model

    @staticmethod
    def not_an_object(rng, model, k, eid, mb):
        v = [[model, eid, TS], "event", 42, None, True, [{"model": model}]][int(rng.integers(6))]
        return orjson.dumps(v), "bad_schema", None

    @staticmethod
    def giant_id(rng, model, k, eid, mb):
        d = {"model": model, "id": "i" * int(rng.integers(257, 2000)), "ts": TS,
             "probs": _probs(rng, k)}
        if rng.random() < 0.5:
            d["model"] = "m" * int(rng.integers(256, 1500))
        return orjson.dumps(d), "bad_schema", model

    @staticmethod
    def non_numeric_entries(rng, model, k, eid, mb):
        p: list = _probs(rng, k)
        p[int(rng.integers(k))] = ["0.5", None, [0.5], {"p": 0.5}, True][int(rng.integers(5))]
        return (orjson.dumps({"model": model, "id": eid, "ts": TS, "probs": p}),
                "bad_schema", None)

    @staticmethod
    def both_or_neither_vector(rng, model, k, eid, mb):
        d = {"model": model, "id": eid, "ts": TS}
        if rng.random() < 0.5:
            d["probs"] = _probs(rng, k)
            d["logits"] = [0.0] * k
        return orjson.dumps(d), "bad_schema", None

    @staticmethod
    def future_ts(rng, model, k, eid, mb):
        # schema-valid, but its event time lies past 2096: beyond any record time plus the skew
        d = {"model": model, "id": eid, "ts": float(rng.integers(4 * 10**9, 10**12)),
             "probs": _probs(rng, k)}
        return orjson.dumps(d), "ts_out_of_range", None

    @staticmethod
    def too_many_classes(rng, model, k, eid, mb):
        n = int(rng.integers(1001, 1900))  # above max_k = 1000, as 0/1 entries: < 4 KB
        probs = [0] * n
        probs[int(rng.integers(n))] = 1
        raw = orjson.dumps({"model": LEARNED_K_MODEL, "id": eid, "ts": TS, "probs": probs})
        assert len(raw) <= mb, "vectors above max_k under max_bytes: raise max_bytes"
        return raw, "k_too_large", LEARNED_K_MODEL

    @staticmethod
    def unknown_model(rng, model, k, eid, mb):
        other = f"ghost-{_ascii(rng, int(rng.integers(1, 40)))}"
        return (orjson.dumps({"model": other, "id": eid, "ts": TS, "probs": _probs(rng, k)}),
                "unknown_model", other)

    @staticmethod
    def wrong_length(rng, model, k, eid, mb):
        n = int(rng.integers(1, 60)) if rng.random() < 0.6 else int(rng.integers(100, 400))
        if n == k:
            n += 1
        raw = orjson.dumps({"model": model, "id": eid, "ts": TS,
                            "probs": [round(1.0 / n, 4)] * n})
        assert len(raw) <= mb, "huge arrays under max_bytes: raise max_bytes"
        return raw, "wrong_length", None

    @staticmethod
    def oversize(rng, model, k, eid, mb):
        if rng.random() < 0.5:
            n = int(rng.integers(mb // 4, mb // 2))  # a huge array: ~20 bytes per entry
            d = {"model": model, "id": eid, "ts": TS, "probs": rng.random(n).tolist()}
        else:
            d = {"model": model, "id": eid, "ts": TS, "probs": _probs(rng, k),
                 "pad": "x" * int(rng.integers(mb, 3 * mb))}
        raw = orjson.dumps(d)
        assert len(raw) > mb
        return raw, "oversize", None

    @staticmethod
    def sum_overflows(rng, model, k, eid, mb):
        p = [0.0] * k
        p[0], p[1] = 1.5e308, float(rng.uniform(1.0e308, 1.7e308))
        return (orjson.dumps({"model": model, "id": eid, "ts": TS, "probs": p}),
                "non_finite", None)

    @staticmethod
    def negative(rng, model, k, eid, mb):
        p = _probs(rng, k)
        j = int(rng.integers(k))
        eps = float(rng.uniform(1e-6, 0.5))
        p[j] -= p[j] + eps        # -eps
        p[(j + 1) % k] += eps + (1.0 - sum(p) - eps)  # keep the sum near 1
        return (orjson.dumps({"model": model, "id": eid, "ts": TS, "probs": p}),
                "negative", None)

    @staticmethod
    def unnormalized(rng, model, k, eid, mb):
        if rng.random() < 0.2:
            p = [0.0] * k
        else:
            scale = float(rng.choice([rng.uniform(0.05, 0.99), rng.uniform(1.01, 50.0)]))
            p = [x * scale for x in _probs(rng, k)]
        return (orjson.dumps({"model": model, "id": eid, "ts": TS, "probs": p}),
                "not_normalized", None)

    @staticmethod
    def label_out_of_range(rng, model, k, eid, mb):
        lab = [k, k + int(rng.integers(1, 1000)), -1, -int(rng.integers(2, 10**9)),
               2 ** 63 - 1][int(rng.integers(5))]
        d = {"model": model, "id": eid, "ts": TS, "label": lab}
        if rng.random() < 0.3:
            d["probs"] = _probs(rng, k)  # a complete sample with a bad label
        return orjson.dumps(d), "label_out_of_range", None
