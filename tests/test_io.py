"""Tests of lpcal.io (loading / validating / saving predictions) and lpcal.datasets."""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lpcal import io
from lpcal.datasets import available_records, load_cifar_record
from lpcal.errors import InputError


def write_csv(path, text: str):
    path.write_text(text)
    return path


def rows(rng, n, k):
    return rng.dirichlet(np.ones(k), size=n), rng.integers(0, k, size=n)


# ----------------------------------------------------------------------------- round trips


def test_npz_roundtrip_and_cifar_key_names(tmp_path):
    rng = np.random.default_rng(0)
    probs, labels = rows(rng, 50, 4)
    p = io.save_npz(tmp_path / "a.npz", probs, labels)
    assert p == tmp_path / "a.npz" and p.exists()
    with np.load(p) as z:
        assert sorted(z.files) == ["labels", "probs"]
    got_p, got_y = io.load_predictions(p)
    np.testing.assert_array_equal(got_p, probs)
    np.testing.assert_array_equal(got_y, labels)
    assert got_p.dtype == np.float64 and got_y.dtype == np.int64
    # CIFAR-record names, float32 predictions
    np.savez(tmp_path / "c.npz", predictions=probs.astype(np.float32), ground_truth=labels)
    got_p, got_y = io.load_predictions(tmp_path / "c.npz", expected_k=4)
    np.testing.assert_allclose(got_p, probs, atol=1e-7)
    np.testing.assert_array_equal(got_y, labels)


def test_npz_without_labels(tmp_path):
    probs = np.full((3, 2), 0.5)
    io.save_npz(tmp_path / "nolab.npz", probs)
    got, y = io.load_predictions(tmp_path / "nolab.npz", require_labels=False)
    assert y is None and got.shape == (3, 2)
    with pytest.raises(InputError, match=r"nolab\.npz: no labels array named 'labels'"):
        io.load_predictions(tmp_path / "nolab.npz")


@settings(max_examples=25, deadline=None)
@given(
    hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=2, max_dims=2, max_side=8),
        elements=st.floats(1e-6, 1.0),
    ),
    st.randoms(use_true_random=False),
)
def test_csv_and_npz_roundtrip_exactly(tmp_path_factory, w, rnd):
    d = tmp_path_factory.mktemp("rt")
    probs = w / w.sum(axis=1, keepdims=True)
    labels = np.array([rnd.randrange(probs.shape[1]) for _ in range(probs.shape[0])])
    for name in ("x.csv", "x.npz"):
        saver = io.save_csv if name.endswith("csv") else io.save_npz
        saver(d / name, probs, labels)
        got_p, got_y = io.load_predictions(d / name)
        np.testing.assert_array_equal(got_p, probs)  # %.17g round-trips float64 exactly
        np.testing.assert_array_equal(got_y, labels)


def test_csv_any_column_order_and_optional_label(tmp_path):
    f = write_csv(tmp_path / "o.csv", "label,p1,p0\n1,0.25,0.75\n0,0.5,0.5\n")
    probs, labels = io.load_predictions(f)
    np.testing.assert_array_equal(probs, [[0.75, 0.25], [0.5, 0.5]])
    np.testing.assert_array_equal(labels, [1, 0])
    f2 = write_csv(tmp_path / "n.csv", "p0,p1\n0.75,0.25\n\n")  # trailing blank line is fine
    probs, labels = io.load_predictions(f2, require_labels=False)
    assert labels is None and probs.shape == (1, 2)


def test_logits_option_applies_stable_softmax(tmp_path):
    z = np.array([[1000.0, 999.0, -5.0], [0.0, 0.0, 0.0], [-1e4, 3.0, 2.0]])
    np.savez(tmp_path / "z.npz", logits=z, labels=np.array([0, 1, 2]))
    probs, _ = io.load_predictions(tmp_path / "z.npz", logits=True)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    np.testing.assert_allclose(probs, e / e.sum(axis=1, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(probs[1], [1 / 3] * 3)
    assert np.isfinite(probs).all()
    f = write_csv(tmp_path / "z.csv", "p0,p1,label\n2.0,-1.0,0\n0,nan,1\n")
    with pytest.raises(InputError, match=r"z\.csv: line 3: logit of class 1 is nan"):
        io.load_predictions(f, logits=True)


# ----------------------------------------------------------------------------- validation errors


@pytest.mark.parametrize(
    "body,match",
    [
        ("p0,p1,label\n0.5,0.5,0\n0.5,nan,1\n", r"line 3: probability of class 1 is nan"),
        ("p0,p1,label\n0.5,0.5,0\ninf,0.5,1\n", r"line 3: probability of class 0 is inf"),
        ("p0,p1,label\n1.5,-0.5,0\n", r"line 2: probability of class 1 is negative \(-0\.5\)"),
        ("p0,p1,label\n0.5,0.5,0\n0.5,0.3,1\n", r"line 3: probabilities sum to 0\.8, not 1"),
        ("p0,p1,label\n0.5,0.5,0\n0.5,0.5,2\n", r"line 3: label 2 outside \[0, 2\)"),
        ("p0,p1,label\n0.5,0.5,-1\n", r"line 2: label -1 outside"),
        ("p0,p1,label\n0.5,0.5,0.5\n", r"line 2: label 0\.5 is not an integer"),
        ("p0,p1,label\n0.5,0.5,0\n0.5,0.5\n", r"line 3: expected 3 fields, got 2"),
        ("p0,p1,label\n0.5,abc,0\n", r"line 2, column 'p1': cannot parse 'abc'"),
        ("p0,p1,label\n0.5,,0\n", r"line 2, column 'p1': cannot parse ''"),
        ("p0,p1,label\n0.5,0.5,0\n\n0.5,0.5,1\n", r"line 3: empty line"),
        ("p0,p2,label\n0.5,0.5,0\n", r"line 1: missing column\(s\) p1"),
        ("p0,p1\n0.5,0.5\n", r"line 1: missing column 'label'"),
        ("p0,p1,label,id\n0.5,0.5,0,7\n", r"line 1: unexpected column 'id'"),
        ("p0,p0,label\n0.5,0.5,0\n", r"duplicate column 'p0'"),
        ("label\n0\n", r"no probability columns"),
        ("p0,p1,label\n", r"empty input \(header but no data rows\)"),
        ("", r"empty file"),
    ],
)
def test_csv_errors_name_file_line_and_problem(tmp_path, body, match):
    f = write_csv(tmp_path / "bad.csv", body)
    with pytest.raises(InputError, match=r"bad\.csv.*" + match):
        io.load_predictions(f)


def test_more_bad_rows_are_counted(tmp_path):
    body = "p0,p1,label\n" + "0.5,0.5,0\n" + "0.6,0.6,1\n" * 3
    f = write_csv(tmp_path / "many.csv", body)
    with pytest.raises(InputError, match=r"line 3 \(and 2 more rows\): probabilities sum to 1\.2"):
        io.load_predictions(f)


def test_k_mismatch_tolerance_and_npz_errors(tmp_path):
    probs = np.full((2, 3), 1 / 3)
    io.save_npz(tmp_path / "k3.npz", probs, [0, 2])
    with pytest.raises(InputError, match=r"k3\.npz: expected 4 classes, got 3"):
        io.load_predictions(tmp_path / "k3.npz", expected_k=4)
    off = np.array([[0.5, 0.50005], [0.5, 0.5]])
    np.savez(tmp_path / "off.npz", probs=off, labels=[0, 1])
    io.load_predictions(tmp_path / "off.npz")  # within the default 1e-4
    with pytest.raises(InputError, match=r"off\.npz: row 0: probabilities sum to 1\.00005"):
        io.load_predictions(tmp_path / "off.npz", tol=1e-6)
    np.savez(tmp_path / "1d.npz", probs=np.array([0.5, 0.5]), labels=[0])
    with pytest.raises(InputError, match=r"1d\.npz: expected a 2-D array"):
        io.load_predictions(tmp_path / "1d.npz")
    np.savez(tmp_path / "empty.npz", probs=np.zeros((0, 3)), labels=np.zeros(0, int))
    with pytest.raises(InputError, match=r"empty\.npz: empty input"):
        io.load_predictions(tmp_path / "empty.npz")
    np.savez(tmp_path / "nokey.npz", scores=probs)
    with pytest.raises(
        InputError, match=r"no array named 'probs' or 'predictions'; found \['scores'\]"
    ):
        io.load_predictions(tmp_path / "nokey.npz")
    np.savez(tmp_path / "len.npz", probs=probs, labels=[0, 1, 2])
    with pytest.raises(InputError, match=r"len\.npz: 3 labels for 2 probability rows"):
        io.load_predictions(tmp_path / "len.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(InputError, match=r"junk\.npz: not a readable \.npz"):
        io.load_predictions(tmp_path / "junk.npz")
    with pytest.raises(InputError, match=r"no such file"):
        io.load_predictions(tmp_path / "missing.npz")
    with pytest.raises(InputError, match=r"unsupported file type '\.txt'"):
        io.load_predictions(tmp_path / "x.txt")


def test_validate_functions_directly():
    x = io.validate_probs([[0.25, 0.75]], where="window 3")
    assert x.dtype == np.float64
    with pytest.raises(InputError, match=r"^window 3: row 0: probability of class 0 is negative"):
        io.validate_probs([[-0.25, 1.25]], where="window 3")
    with pytest.raises(InputError, match=r"^event batch: record 7: probabilities sum"):
        io.validate_probs(
            np.array([[0.5, 0.5]] * 7 + [[0.9, 0.9]]),
            where="event batch",
            row_name=lambda i: f"record {i}",
        )
    with pytest.raises(InputError, match="not a numeric array"):
        io.validate_probs([["a", "b"]])
    np.testing.assert_array_equal(io.validate_labels(np.array([1.0, 0.0]), 2), [1, 0])
    with pytest.raises(InputError, match="labels must be integers, got dtype bool"):
        io.validate_labels(np.array([True, False]), 2)
    with pytest.raises(InputError, match=r"row 0: label 1e\+300 outside \[0, 2\)"):
        io.validate_labels(np.array([1e300]), 2)
    with pytest.raises(InputError, match="expected a 1-D array of labels"):
        io.validate_labels(np.zeros((2, 2), int), 2)


def test_save_validates_and_is_atomic(tmp_path):
    with pytest.raises(InputError, match=r"out\.npz: row 0: probabilities sum to 2"):
        io.save_npz(tmp_path / "out.npz", [[1.0, 1.0]])
    assert not (tmp_path / "out.npz").exists()
    assert list(tmp_path.iterdir()) == []  # no temp file left behind
    (tmp_path / "sub").mkdir()
    path = io.save_npz(tmp_path / "sub" / "out", [[0.5, 0.5]], [1])  # no '.npz' appended
    assert path.name == "out" and path.exists()


def test_write_output_creates_no_directory_and_names_the_problem(tmp_path):
    with pytest.raises(InputError, match="directory .*missing.* does not exist"):
        io.save_npz(tmp_path / "missing" / "x.npz", [[0.5, 0.5]])
    assert not (tmp_path / "missing").exists()
    with pytest.raises(InputError, match="is a directory"):
        io.write_output(tmp_path, b"x")
    with pytest.raises(InputError, match=r"/proc/x\.json: cannot write"):
        io.write_output("/proc/x.json", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_write_output_gives_the_mode_of_a_normal_file(tmp_path, umask):
    old = os.umask(umask)
    try:
        a = io.write_output(tmp_path / "a.json", b"{}")
        b = io.save_npz(tmp_path / "b.npz", [[0.5, 0.5]])
        with open(tmp_path / "c.txt", "w") as fh:  # what open() gives under this umask
            fh.write("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE(os.stat(tmp_path / "c.txt").st_mode)
    assert want == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(a).st_mode) == want
    assert stat.S_IMODE(os.stat(b).st_mode) == want


# ----------------------------------------------------------------------------- bundled data


def test_bundled_cifar_record():
    assert "wideresnet-16-4-cifar-10" in available_records()
    probs, labels = load_cifar_record()
    assert probs.shape == (10000, 10) and labels.shape == (10000,)
    assert probs.dtype == np.float64 and labels.dtype == np.int64
    assert np.abs(probs.sum(axis=1) - 1).max() < 1e-5
    acc = float(np.mean(probs.argmax(axis=1) == labels))
    assert 0.85 < acc < 0.97  # a WideResNet-16-4 on CIFAR-10 (about 0.91)
    with pytest.raises(InputError, match=re.escape("unknown record 'resnet'")):
        load_cifar_record("resnet")
