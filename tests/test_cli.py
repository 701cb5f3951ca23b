"""The ``lpcal`` command line (:mod:`lpcal.cli`, run through the console script's
:func:`daemon.cli.main`): output paths and modes, help texts, argument checks, authentication
warnings and ``keygen``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from daemon.cli import main
from lpcal.datasets import load_cifar_record
from lpcal.signing import Signer


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    probs, labels = load_cifar_record()
    np.savez(d / "in.npz", probs=probs[:3000], labels=labels[:3000])
    assert main(["fit", "--input", str(d / "in.npz"), "--eps", "0.1", "--p", "inf",
                 "--out", str(d / "map.json")]) == 0
    return d


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("where", ["missing", "proc", "directory"])
def test_fit_out_that_cannot_be_written_is_a_one_line_error(sample, tmp_path, capsys, where):
    out = {"missing": tmp_path / "no" / "such" / "map.json", "proc": Path("/proc"),
           "directory": tmp_path}[where]
    capsys.readouterr()
    assert main(["fit", "--input", str(sample / "in.npz"), "--eps", "0.1", "--p", "inf",
                 "--out", str(out)]) == 2
    _one_line_error(capsys, "lpcal fit: error:", str(out))
    assert not (tmp_path / "no").exists()


def test_fit_out_in_proc_is_refused_when_writing(sample, capsys):
    capsys.readouterr()
    assert main(["fit", "--input", str(sample / "in.npz"), "--eps", "0.1", "--p", "inf",
                 "--out", "/proc/lpcal-map.json"]) == 2
    _one_line_error(capsys, "/proc/lpcal-map.json: cannot write")


def test_apply_out_creates_no_directory(sample, tmp_path, capsys):
    out = tmp_path / "nonexistent" / "dir" / "x.npz"
    capsys.readouterr()
    assert main(["apply", "--binmap", str(sample / "map.json"), "--input",
                 str(sample / "in.npz"), "--out", str(out)]) == 2
    _one_line_error(capsys, "does not exist")
    assert not (tmp_path / "nonexistent").exists()


def test_fit_and_apply_write_files_with_the_same_mode(sample, tmp_path):
    old = os.umask(0o022)
    try:
        assert main(["fit", "--input", str(sample / "in.npz"), "--eps", "0.1", "--p", "inf",
                     "--out", str(tmp_path / "m.json")]) == 0
        assert main(["apply", "--binmap", str(tmp_path / "m.json"), "--input",
                     str(sample / "in.npz"), "--out", str(tmp_path / "o.npz")]) == 0
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in ("m.json", "o.npz")}
    assert modes == {0o644}


def test_eval_lam_must_be_positive(sample, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--input", str(sample / "in.npz"), "--lam", "0"])
    assert e.value.code == 2
    assert "lambda must be a positive integer, got '0'" in capsys.readouterr().err
    assert main(["eval", "--input", str(sample / "in.npz"), "--lam", "7"]) == 0


def test_not_authenticated_only_for_signed_maps_without_a_key(sample, tmp_path, capsys):
    args = ["--input", str(sample / "in.npz")]
    capsys.readouterr()
    # an unsigned map the user just fitted: no key could be given, nothing to warn about
    assert main(["eval", "--binmap", str(sample / "map.json"), *args]) == 0
    assert main(["apply", "--binmap", str(sample / "map.json"), *args,
                 "--out", str(tmp_path / "o.npz")]) == 0
    assert "authenticated" not in capsys.readouterr().err
    # a signed map read without --public-key: one warning per command
    from lpcal.binmap import BinMap

    signer = Signer(bytes(32))
    signed = tmp_path / "signed.json"
    signed.write_bytes(BinMap.from_json((sample / "map.json").read_bytes()).to_json(
        signer=signer))
    assert main(["eval", "--binmap", str(signed), *args]) == 0
    err = capsys.readouterr().err
    assert err.count("not authenticated") == 1 and signer.key_id in err
    assert "--public-key" in err


def _help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["fit"], ["apply"], ["eval"], ["keygen"]])
def test_help_has_no_rest_markup(command, capsys):
    text = _help([*command, "--help"], capsys)
    assert "``" not in text and ":func:" not in text and ":mod:" not in text


def test_fit_help_documents_input_eps_and_out(capsys):
    text = " ".join(_help(["fit", "--help"], capsys).split())
    for words in ("'probs' (float, shape (n, k)", "'labels' (int, shape (n,)", ".csv",
                  "target lp calibration error", "the bin map to write", "a number > 1, or inf"):
        assert words in text, words


def test_keygen_writes_the_file_the_daemon_reads_and_refuses_to_overwrite(tmp_path, capsys):
    from daemon.settings import load_settings

    keys = tmp_path / "keys"
    assert main(["keygen", str(keys)]) == 0
    out = capsys.readouterr().out
    private, public = keys / "signing__private_key", keys / "binmap-signing.pub"
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    assert "next steps" in out and "LPCAL_SECRETS_DIR" in out and str(public) in out
    # the daemon, pointed at the directory, signs with it (the public key file beside it is
    # no setting and is ignored)
    toml = tmp_path / "lpcal.toml"
    toml.write_text("")
    signer = load_settings(toml, secrets_dir=keys).signing.signer()
    assert signer is not None and signer.key_id in out
    from lpcal.signing import key_id

    assert key_id(public) == signer.key_id
    before = private.read_bytes()
    assert main(["keygen", str(keys)]) == 2
    _one_line_error(capsys, "already exist", "never overwritten")
    assert private.read_bytes() == before


def test_python_m_lpcal_signing_runs_without_warnings(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    r = subprocess.run([sys.executable, "-m", "lpcal.signing", "--help"], capture_output=True,
                       text=True, env=env, timeout=60, check=False)
    assert r.returncode == 0 and "RuntimeWarning" not in r.stderr and "DIR" in r.stdout
    r = subprocess.run([sys.executable, "-m", "lpcal.signing", str(tmp_path / "k")],
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 0 and r.stderr == ""
    assert (tmp_path / "k" / "signing__private_key").is_file()
