"""The event reader of daemon._speedups (daemon/csrc/event_json.c) against orjson.

``scan`` reads the common shape of an event straight from its bytes and leaves every other
value to ``orjson.loads``. What it reads must be exactly what orjson and scan's field checks
give (every bit of every double); what it cannot read so must be declined, never guessed. Each
test compares the bytes path with orjson on the same values and checks that the bytes path is
really taken where it should be (a reader that declined everything would pass the comparisons).
"""

from __future__ import annotations

import json
import struct
from decimal import Decimal

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import daemon.native

NATIVE = daemon.native.KERNELS.module
pytestmark = pytest.mark.skipif(NATIVE is None, reason="daemon._speedups is not built here")

MAX_MODEL, MAX_ID = 64, 64


def fields(value: bytes):
    return NATIVE.event_fields(value, MAX_MODEL, MAX_ID)


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def read_number(token: str):
    """The probability ``token`` as the bytes reader reads it, or None if declined."""
    got = fields(b'{"model":"m","id":"i","ts":0,"probs":[' + token.encode() + b"]}")
    return None if got is None else got[4][0]


def assert_numbers_exact(tokens: list[str]) -> int:
    """Every token read by the bytes reader has the bits of orjson's value; returns how many
    were read."""
    read = 0
    for t in tokens:
        got = read_number(t)
        if got is None:
            continue
        read += 1
        assert bits(got) == bits(float(orjson.loads(t))), t
    return read


def test_reprs_of_probabilities_are_read_and_exact():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(10, 0.3), 5_000).ravel()
    tokens = [repr(float(v)) for v in p] + [json.dumps(float(v)) for v in p[:2_000]]
    read = assert_numbers_exact(tokens)
    assert read >= 0.99 * len(tokens)  # the bytes path is the common one


def test_doubles_over_a_wide_range_are_exact_where_read():
    rng = np.random.default_rng(1)
    x = np.exp(rng.uniform(-70, 70, 40_000)) * rng.choice([-1.0, 1.0], 40_000)
    tokens = [repr(float(v)) for v in x]
    read = assert_numbers_exact(tokens)
    assert read >= 0.5 * len(tokens)


def test_decimal_strings_of_up_to_19_digits_are_correctly_rounded():
    rng = np.random.default_rng(2)
    tokens = []
    for _ in range(40_000):
        digits = "".join(rng.choice(list("0123456789"), int(rng.integers(1, 20)))).lstrip("0")
        digits = digits or "0"
        e = int(rng.integers(-30, 31))
        tokens.append(f"{digits}e{e}" if rng.random() < 0.5 else f"-0.{digits}")
    assert assert_numbers_exact(tokens) >= 0.8 * len(tokens)


def test_values_next_to_halfway_points_are_exact_or_declined():
    """Decimal prefixes of the midpoint of two adjacent doubles: the hardest to round."""
    rng = np.random.default_rng(3)
    tokens = []
    for v in rng.uniform(0, 1, 3_000):
        a = float(v)
        mid = (Decimal(a) + Decimal(float(np.nextafter(a, 2.0)))) / 2
        tokens += [format(mid, "f")[:n] for n in (19, 20, 21)]
    assert assert_numbers_exact(tokens) > 0


def test_exact_halfway_products_are_declined():
    """Odd integers between 2^53 and 2^54 lie halfway between two doubles: as float tokens
    their 64-bit-exact values have extra bits 0x400, which the reader must not round itself."""
    assert read_number("9007199254740993e0") is None
    assert read_number("9007199254740995e0") is None
    assert read_number("9007199254740992e0") == 2.0**53
    assert bits(read_number("9007199254740996e0")) == bits(9007199254740996e0)
    assert bits(read_number("0.9007199254740993")) == bits(0.9007199254740993)


def test_integer_tokens_are_ints_as_orjson_gives_them():
    assert bits(read_number("-0")) == bits(0.0)      # the int 0, not -0.0
    assert bits(read_number("-0.0")) == bits(-0.0)
    assert read_number(str(2**53)) == 2.0**53
    assert read_number(str(2**53 + 1)) is None       # scan rejects such ints: orjson path
    assert read_number("1E2") == 100.0 and read_number("5e-1") == 0.5


@pytest.mark.parametrize("token", ["01", "1.", ".5", "+1", "1e", "1e+", "-", "NaN", "Infinity",
                                   "0x10", "1_0", "1e99999", "12345678901234567890",
                                   "1e-40", "1e40"])
def test_numbers_outside_the_read_grammar_are_declined(token):
    assert read_number(token) is None


GOOD = b'{"model":"m","id":"e1","ts":12.5,"probs":[0.25,0.75]}'


@pytest.mark.parametrize("value", [
    b'{"model":"m","id":"e\\u0031","ts":12.5,"probs":[0.25,0.75]}',   # escape
    b'{"model":"m\xc3\xa9","id":"e1","ts":12.5,"probs":[0.25,0.75]}',  # non-ASCII
    b'{"model":"m","id":"e1","ts":12.5,"probs":[0.25,0.75],"x":{}}',  # nested
    b'{"model":"m","id":"e1","ts":12.5,"probs":[0.25,0.75],"x":null}',
    b'{"model":"m","id":"e1","ts":12.5,"probs":[0.25,0.75],"id":"e2"}',  # repeated key
    b'{"model":"m","id":"e1","ts":12.5,"probs":[0.25,0.75],"logits":[1]}',
    b'{"model":"m","id":"e1","ts":12.5,"probs":[[0.25],0.75]}',
    b'{"model":"m","id":"e1","ts":12.5,"probs":null,"label":1}',
    b'{"model":"m","id":"e1","ts":12.5}',                              # no probs nor label
    b'{"model":"m","id":"","ts":12.5,"label":1}',                      # empty id
    b'{"model":"m","id":"e1","ts":12.5,"label":-1}',
    b'{"model":"m","id":"e1","ts":12.5,"label":1.0}',
    b'{"model":"m","id":"e1","ts":"12.5","label":1}',
    b'{"model":"m","id":"e1","ts":12.5,"label":1}x',                   # trailing bytes
    b'{"model":"m","id":"e1","ts":12.5,"label":1,}',
    b'{"model":"m","id":"e1" "ts":12.5,"label":1}',
    b'\xef\xbb\xbf{"model":"m","id":"e1","ts":12.5,"label":1}',         # BOM
    b'{"model":"m","id":"e1\x01","ts":12.5,"label":1}',                # control character
    b'{"model":"' + b"m" * (MAX_MODEL + 1) + b'","id":"e1","ts":1,"label":1}',
    b'[1,2]', b"", b"{}", GOOD[:-1], GOOD[:30],
])
def test_other_shapes_are_declined(value):
    assert fields(value) is None


def test_the_common_shapes_are_read():
    assert fields(GOOD) == ("m", "e1", 12.5, -1, [0.25, 0.75])
    spaced = b' { "ts" : 7 ,\n "label" : 2 , "id" : "a b" , "model" : "m" , "x" : "y" } \r\n'
    assert fields(spaced) == ("m", "a b", 7.0, 2, None)
    extra = b'{"model":"m","id":"i","ts":1,"probs":[],"v":-1.5e3,"f":false,"t":true}'
    assert fields(extra) == ("m", "i", 1.0, -1, [])


def scan_both(values: list[bytes]):
    """scan on the bytes (the reader, orjson for what it declines) and scan on orjson's
    objects: the same columns, or None both."""
    direct = NATIVE.scan(list(values), MAX_MODEL, MAX_ID, orjson.loads, 1 << 16)
    try:
        parsed = [orjson.loads(v) for v in values]
    except orjson.JSONDecodeError:
        return direct, None
    return direct, NATIVE.scan(parsed, MAX_MODEL, MAX_ID)


def assert_scan_equal(values: list[bytes]):
    direct, ref = scan_both(values)
    assert (direct is None) == (ref is None), values
    if direct is not None:
        assert direct[:2] == ref[:2]
        assert all(bytes(a) == bytes(b) for a, b in zip(direct[2:], ref[2:]))


@st.composite
def event_bytes(draw):
    num = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-2**60, 2**60),
                    st.sampled_from([0.0, -0.0, 1e-30, 5e-324, 1e300, 0.1, 2**53 + 1]))
    d = {"model": draw(st.sampled_from(["m", "n", "é", "", "x" * 70, "a\\b"])),
         "id": draw(st.text(alphabet=st.characters(max_codepoint=300), min_size=0, max_size=5)),
         "ts": draw(num)}
    if draw(st.booleans()):
        d["probs"] = draw(st.lists(num, max_size=4))
    if draw(st.booleans()):
        d["label"] = draw(st.one_of(st.integers(-2, 2**64), st.booleans(), st.none()))
    if draw(st.booleans()):
        d[draw(st.sampled_from(["x", "logits", "probsx"]))] = draw(
            st.one_of(num, st.text(max_size=3), st.booleans(), st.none(), st.lists(num, max_size=2)))
    keys = draw(st.permutations(list(d)))
    sep = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " : ")]))
    raw = json.dumps({k: d[k] for k in keys}, separators=sep, ensure_ascii=draw(st.booleans()))
    return raw.encode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event_bytes(), min_size=1, max_size=5))
def test_scan_of_bytes_equals_scan_of_orjson_objects(values):
    assert_scan_equal(values)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(event_bytes(), st.binary(max_size=40)), min_size=1, max_size=4),
       st.data())
def test_scan_of_damaged_bytes_equals_scan_of_orjson_objects(values, data):
    """Truncated, spliced and random bytes: the reader declines or reads what orjson reads."""
    cut = [v[:data.draw(st.integers(0, len(v)))] if data.draw(st.booleans()) else v
           for v in values]
    assert_scan_equal(cut)


def test_a_batch_of_common_events_is_read_from_bytes_and_equals_orjson():
    rng = np.random.default_rng(4)
    values = []
    for i in range(2_000):
        d = {"model": f"model-{i % 7}", "id": f"id-{i}", "ts": 1.7e9 + i / 100}
        if i % 3:
            d["probs"] = rng.dirichlet(np.ones(10)).tolist()
        else:
            d["label"] = int(rng.integers(0, 10))
        values.append(orjson.dumps(d))
    assert sum(fields(v) is not None for v in values) >= 0.99 * len(values)
    assert_scan_equal(values)
