"""Generate the scikit-learn prediction records of the quality benchmark (``tests/bench/data``).

Run: ``python -m tests.bench.make_sklearn_records [--out DIR]`` (default ``DIR`` is
``tests/bench/data``). It rewrites the six files below bit for bit (same scikit-learn, numpy and
zlib versions; BLAS and OpenMP are limited to one thread) and prints, per record, ``n``, ``k``,
accuracy, NLL, top-label ECE (15 equal-width bins) and the NLL-optimal temperature ``T`` of
temperature scaling. Written with scikit-learn 1.9.1, numpy 2.4.6 (CPython 3.11, x86-64).

Provenance
----------
Datasets: the copies bundled with scikit-learn (no download), all features, no preprocessing
besides the scaler of the MLP pipeline:

* ``digits``: ``sklearn.datasets.load_digits``, n = 1797, k = 10 (8x8 handwritten digits);
* ``wine``: ``sklearn.datasets.load_wine``, n = 178, k = 3;
* ``breast-cancer``: ``sklearn.datasets.load_breast_cancer``, n = 569, k = 2.

Models (``random_state = 0`` everywhere):

* ``mlp``: ``StandardScaler`` then ``MLPClassifier(hidden_layer_sizes=(100,), activation="relu",
  solver="adam", alpha=1e-6, batch_size="auto", learning_rate_init=1e-3, max_iter=2000, tol=0,
  n_iter_no_change=2000)``: practically no L2 penalty and 2000 full epochs (no early stop), so
  the training loss goes to ~0 and the out-of-fold outputs are overconfident (``T > 1``).
  scikit-learn's ``ConvergenceWarning`` about reaching ``max_iter`` is expected and silenced.
* ``gbdt``: ``HistGradientBoostingClassifier(learning_rate=0.1, max_iter=200,
  max_leaf_nodes=31, min_samples_leaf=20, l2_regularization=0, early_stopping=False)``.

Out-of-fold predictions: ``StratifiedKFold(n_splits=5, shuffle=True, random_state=0)``; each
sample's probability vector comes from the model trained on the four folds that do not contain
it, so every sample is predicted exactly once by a model that never saw it. Rows are
``predict_proba`` outputs as they are (float64, not renormalised; the MLP's softmax can underflow
to exact zeros on ``breast-cancer``).

File layout: :func:`lpcal.io.save_npz`, i.e. keys ``probs`` (float64, (n, k)) and ``labels``
(int64, (n,)), which :func:`lpcal.io.load_predictions` reads like the ``predictions`` /
``ground_truth`` keys of the CIFAR records. numpy stamps the current time into the zip entries;
the files are rewritten with a fixed timestamp (1980-01-01) so that regenerating them is
byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lpcal import metrics
from lpcal.io import load_predictions, save_npz
from lpcal.temperature import fit_temperature

DATA = Path(__file__).resolve().parent / "data"
SEED = 0
N_SPLITS = 5
DATASETS = ("digits", "wine", "breast-cancer")
MODELS = ("mlp", "gbdt")
RECORDS = [f"{m}-{d}" for d in DATASETS for m in MODELS]
"""Record names (file stems), in generation order."""

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def load_dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Features ``X`` (float64) and labels ``y`` (int64) of a bundled scikit-learn dataset."""
    from sklearn import datasets

    loader = {
        "digits": datasets.load_digits,
        "wine": datasets.load_wine,
        "breast-cancer": datasets.load_breast_cancer,
    }[name]
    x, y = loader(return_X_y=True)
    return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)


def make_model(kind: str):
    """A fresh, unfitted estimator of the given kind (see the module docstring)."""
    if kind == "mlp":
        from sklearn.neural_network import MLPClassifier
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        return make_pipeline(
            StandardScaler(),
            MLPClassifier(
                hidden_layer_sizes=(100,),
                activation="relu",
                solver="adam",
                alpha=1e-6,
                batch_size="auto",
                learning_rate_init=1e-3,
                max_iter=2000,
                tol=0.0,
                n_iter_no_change=2000,
                random_state=SEED,
            ),
        )
    if kind == "gbdt":
        from sklearn.ensemble import HistGradientBoostingClassifier

        return HistGradientBoostingClassifier(
            learning_rate=0.1,
            max_iter=200,
            max_leaf_nodes=31,
            min_samples_leaf=20,
            l2_regularization=0.0,
            early_stopping=False,
            random_state=SEED,
        )
    raise ValueError(f"unknown model kind {kind!r}")


def out_of_fold(make: Callable[[], object], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Out-of-fold ``predict_proba`` of 5-fold stratified cross-validation, shape (n, k)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import StratifiedKFold

    k = int(y.max()) + 1
    probs = np.full((y.size, k), np.nan)
    folds = StratifiedKFold(n_splits=N_SPLITS, shuffle=True, random_state=SEED)
    for train, test in folds.split(x, y):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model = make().fit(x[train], y[train])
        probs[test] = model.predict_proba(x[test])
    return probs


def _fix_zip_times(path: Path) -> None:
    """Rewrite the zip archive ``path`` with every entry dated :data:`_ZIP_EPOCH` (same bytes)."""
    with zipfile.ZipFile(path) as zin:
        entries = [(info, zin.read(info)) for info in zin.infolist()]
    tmp = path.with_name(f".{path.name}.fix")
    with zipfile.ZipFile(tmp, "w") as zout:
        for info, data in entries:
            fixed = zipfile.ZipInfo(info.filename, date_time=_ZIP_EPOCH)
            fixed.compress_type = info.compress_type
            fixed.external_attr = info.external_attr
            with zout.open(fixed, "w", force_zip64=True) as fh:
                fh.write(data)
    os.replace(tmp, path)


def write_record(path: Path, probs: np.ndarray, labels: np.ndarray) -> str:
    """Save with :func:`lpcal.io.save_npz`, fix the zip timestamps, return the file's SHA-256."""
    save_npz(path, probs, labels)
    _fix_zip_times(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_stats(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """``n``, ``k``, accuracy, NLL, top-label ECE (15 equal-width bins) and the TS temperature."""
    return {
        "n": probs.shape[0],
        "k": probs.shape[1],
        "accuracy": metrics.accuracy(probs, labels),
        "nll": metrics.nll(probs, labels),
        "top_label_ece": metrics.top_label_ece(probs, labels, n_bins=15),
        "temperature": fit_temperature(probs, labels),
    }


def generate(out: Path = DATA) -> dict[str, dict]:
    """Train, predict out of fold and write every record to ``out``; return stats per record."""
    from threadpoolctl import threadpool_limits

    results: dict[str, dict] = {}
    with threadpool_limits(limits=1):
        for ds in DATASETS:
            x, y = load_dataset(ds)
            for kind in MODELS:
                name = f"{kind}-{ds}"
                probs = out_of_fold(lambda kind=kind: make_model(kind), x, y)
                sha = write_record(out / f"{name}.npz", probs, y)
                p2, y2 = load_predictions(out / f"{name}.npz")
                if not (np.array_equal(p2, probs) and np.array_equal(y2, y)):
                    raise RuntimeError(f"{name}: record does not read back identically")
                results[name] = {**record_stats(probs, y), "sha256": sha}
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DATA, help="output folder (default: %(default)s)")
    args = ap.parse_args(argv)
    import sklearn

    print(f"scikit-learn {sklearn.__version__}, numpy {np.__version__}")
    results = generate(args.out)
    print("| record | n | k | accuracy | NLL | top-label ECE | TS temperature | SHA-256 |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for name, s in results.items():
        print(f"| {name} | {s['n']} | {s['k']} | {s['accuracy']:.4f} | {s['nll']:.4f} | "
              f"{s['top_label_ece']:.4f} | {s['temperature']:.3f} | `{s['sha256']}` |")
        if name.startswith("mlp-"):
            ok &= s["temperature"] > 1.0 and s["top_label_ece"] > 0.005
    print("MLP records overconfident (T > 1 and top-label ECE > 0.005):", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
