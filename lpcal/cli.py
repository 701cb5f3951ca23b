"""The ``lpcal`` command line: ``fit``, ``apply``, ``eval``, ``keygen`` (library) and ``serve``,
``simulate``, ``broker`` (the daemon and its tools).

This module is the library's part and imports nothing from ``daemon``. The ``lpcal`` console
script is :func:`daemon.cli.main`: it runs the daemon's commands itself and hands every other
command to :func:`main` here, passing its commands in ``commands`` so that ``lpcal --help``
lists them. Without them (``python -m lpcal.cli serve``) a daemon command exits 2 with a hint.

Exit codes: 0 success, 2 bad input or arguments (the message says what and where), 1 other errors.
Every output file is written by :func:`lpcal.io.write_output` (atomically, mode 0644 under the
usual umask, no directory created).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from lpcal.binmap import BinMap
from lpcal.errors import InputError, LpcalError
from lpcal.io import check_output_path, load_predictions, save_npz, write_output
from lpcal.spec import (
    EPS_AUTO,
    P_DOMAIN,
    FitSpec,
    Mode,
    Outside,
    Prescale,
    SizingRule,
    Variant,
    parse_p,
)


def _p(text: str) -> float:
    try:
        return parse_p(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lam(text: str) -> int:
    try:
        lam = int(text)
    except ValueError:
        lam = 0
    if lam < 1:
        raise argparse.ArgumentTypeError(f"lambda must be a positive integer, got {text!r}")
    return lam


def _eps(text: str) -> float | str:
    if text.lower() == EPS_AUTO:
        return EPS_AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"eps must be a number in (0, 1) or 'auto', got "
                                         f"{text!r}") from None


class _Progress:
    """A progress line on stderr: redrawn in place on a terminal, every 2 s otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty, self.t0, self.last = stream, stream.isatty(), time.time(), 0.0

    def __call__(self, t: int, err_max: float) -> None:
        now = time.time()
        if not self.tty and now - self.last < 2.0:
            return
        self.last = now
        msg = f"fit: iteration {t}, largest estimated error {err_max:.5f}, {now - self.t0:.1f} s"
        self.stream.write(("\r" + msg) if self.tty else (msg + "\n"))
        self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _read_binmap(path: str, public_keys: list[str] | None = None) -> BinMap:
    """Load and verify ``path``; with ``--public-key`` files, a valid signature by one of them
    is required (else exit 2 naming the signature problem)."""
    from lpcal.signing import KeyRing

    p = Path(path)
    try:
        data = p.read_bytes()
        ring = KeyRing([Path(k) for k in public_keys]) if public_keys else None
    except OSError as e:
        raise LpcalError(f"{e.filename or p}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise LpcalError(f"--public-key: {e}") from None
    bm = BinMap.from_json(data, where=str(p), public_keys=ring)
    if ring is not None:
        print(f"{p}: signed by key id {bm.verified_by}, verified")
    elif bm.signature_key_id is not None:  # a key exists that could have been given
        print(f"lpcal: warning: {p} is signed (key id {bm.signature_key_id}) but not "
              f"authenticated: pass the daemon's public key with --public-key FILE",
              file=sys.stderr)
    return bm


def cmd_fit(a) -> int:
    from lpcal.calibrate import fit

    check_output_path(a.out)
    spec = FitSpec(eps=a.eps, p=a.p, delta=a.delta, pool_size=a.pool_size, sizing=a.sizing,
                   seed=a.seed, mode=a.mode, prescale=a.prescale, outside=a.outside,
                   holdout_fraction=a.holdout_fraction, variant=a.variant)
    probs, labels = load_predictions(a.input, logits=a.logits)
    prog = _Progress()
    t0 = time.time()
    bm = fit(probs, labels, spec, model_id=a.model_id, progress=prog)
    prog.done()
    write_output(a.out, bm.to_json())
    s = bm.summary()
    print(f"wrote {a.out}: mode={bm.mode}, |B| = {s['|B|']}, |G| = {s['|G|']}, "
          f"{s['iterations']} iterations ({s['stop_reason']}), lambda = {bm.lam}, "
          f"temperature {'none' if bm.temperature is None else f'{bm.temperature:.4g}'}, "
          f"fit {time.time() - t0:.2f} s")
    if a.eps == EPS_AUTO:
        print(f"eps auto: {bm.eps:g} (lambda = {bm.lam})")
    if bm.certificate is not None:
        print(bm.certificate.format())
    return 0


def cmd_apply(a) -> int:
    check_output_path(a.out)
    bm = _read_binmap(a.binmap, a.public_key)
    probs, _ = load_predictions(a.input, logits=a.logits, expected_k=bm.k, require_labels=False)
    out = bm.apply(probs)
    save_npz(a.out, out)
    print(f"wrote {a.out}: {out.shape[0]} rows calibrated with {a.binmap} (version {bm.version})")
    return 0


def cmd_eval(a) -> int:
    from lpcal.report import evaluate, format_table

    bm = _read_binmap(a.binmap, a.public_key) if a.binmap else None
    probs, labels = load_predictions(a.input, logits=a.logits,
                                     expected_k=bm.k if bm else None)
    lam = a.lam if a.lam is not None else (bm.lam if bm else 20)
    cols = {"raw": evaluate(probs, labels, lam)}
    curves = {"raw": (probs, labels)}
    if bm is not None:
        cal = bm.apply(probs)
        cols["calibrated"] = evaluate(cal, labels, lam)
        curves["calibrated"] = (cal, labels)
    print(format_table(cols, lam, probs.shape[0]))
    if bm is not None:
        if bm.certificate is not None:
            print(bm.certificate.format())
        else:
            print(f"certificate: none (a {bm.mode}-mode map fitted without a held-out share)")
    if a.plot:
        from lpcal.plot import reliability_diagram

        print(f"wrote {reliability_diagram(a.plot, curves)}")
    return 0


#: A command that parses its own arguments: ``name -> (help, run(argv) -> exit code)``.
Commands = Mapping[str, tuple[str, Callable[[list[str]], int]]]

#: Commands of the daemon and its tools, run by the ``lpcal`` console script (daemon.cli).
DAEMON_COMMANDS = ("serve", "simulate", "broker")


_PUBKEY_HELP = ("Ed25519 public key of the daemon (PEM, raw 32 bytes or base64); repeat for "
                "several (key rotation). The bin map must be signed by one of them. Without "
                "it the map is not authenticated (a signed map gets a warning)")
_INPUT_HELP = ("labelled predictions: .npz with arrays 'probs' (float, shape (n, k), rows "
               "summing to 1; or 'logits' with --logits) and 'labels' (int, shape (n,), "
               "classes 0..k-1); the names 'predictions'/'ground_truth' are accepted too. Or "
               ".csv with a header p0,...,p{k-1},label and one sample per line")


def _values(enum) -> list[str]:
    """The choices of an option typed by one of :mod:`lpcal.spec`'s enums."""
    return [e.value for e in enum]


def cmd_keygen(a) -> int:
    from lpcal.signing import main as keygen_main

    return keygen_main([a.dir], prog="lpcal keygen")


def build_parser(commands: Commands | None = None) -> argparse.ArgumentParser:
    """The parser of the library's commands, plus ``commands`` (listed in ``--help``; each
    takes every argument after its name)."""
    ap = argparse.ArgumentParser(
        prog="lpcal", description="lpcal: calibrate multiclass predictions under lp error "
        "(fit, apply and evaluate bin maps; run the calibration daemon)")
    sub = ap.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fit", help="fit a bin map on labelled predictions (.npz or .csv)")
    f.add_argument("--input", required=True, metavar="FILE", help=_INPUT_HELP)
    f.add_argument("--eps", type=_eps, required=True,
                   help="target lp calibration error Err_p, in (0, 1), e.g. 0.05; or 'auto': the "
                        "smallest eps a model as good as temperature scaling certifies at this "
                        "sample size")
    f.add_argument("--p", type=_p, required=True, help=f"the p of Err_p: {P_DOMAIN} ('inf')")
    f.add_argument("--delta", type=float, default=0.1,
                   help="failure probability; the certificate's level is 1 - delta (default 0.1)")
    f.add_argument("--pool-size", type=int, default=None,
                   help="practical sizing: samples per pool (default: split the input evenly)")
    f.add_argument("--sizing", choices=_values(SizingRule), default=SizingRule.PRACTICAL.value)
    f.add_argument("--variant", choices=_values(Variant), default=Variant.SHARED.value,
                   help="shared (default): P and E of a group from one pool; split: the paper's separate pools")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--mode", choices=_values(Mode), default=Mode.CERTIFIED.value,
                   help="certified (default): held-out certificate, temperature pre-calibration, "
                        "the better of TS alone and the corrected map; paper: Algorithm 2 as "
                        "published")
    f.add_argument("--prescale", choices=_values(Prescale), default=None,
                   help="pre-calibrator (default from --mode: temperature | none)")
    f.add_argument("--outside", choices=_values(Outside), default=None,
                   help="map outside B (default from --mode: identity | rho)")
    f.add_argument("--holdout-fraction", type=float, default=None,
                   help="share held out for the certificate (default from --mode: 0.3 | 0)")
    f.add_argument("--model-id", default="model")
    f.add_argument("--logits", action="store_true", help="inputs are logits: softmax first")
    f.add_argument("--out", required=True, metavar="FILE",
                   help="the bin map to write (JSON; its directory must exist)")
    f.set_defaults(run=cmd_fit)

    p = sub.add_parser("apply", help="apply a bin map; writes probs to an .npz")
    p.add_argument("--binmap", required=True, metavar="FILE", help="bin map (JSON) to apply")
    p.add_argument("--input", required=True, metavar="FILE",
                   help="predictions (.npz 'probs' (n, k) or .csv p0..p{k-1}; labels optional)")
    p.add_argument("--logits", action="store_true", help="inputs are logits: softmax first")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="calibrated probabilities, .npz array 'probs' (its directory must exist)")
    p.add_argument("--public-key", action="append", metavar="FILE", help=_PUBKEY_HELP)
    p.set_defaults(run=cmd_apply)

    e = sub.add_parser("eval", help="calibration metrics, before/after a bin map")
    e.add_argument("--input", required=True, metavar="FILE", help=_INPUT_HELP)
    e.add_argument("--binmap", metavar="FILE", help="bin map (JSON) to evaluate")
    e.add_argument("--lam", type=_lam, default=None,
                   help="lambda for Err_p (default: the bin map's, else 20)")
    e.add_argument("--logits", action="store_true")
    e.add_argument("--plot", metavar="PNG")
    e.add_argument("--public-key", action="append", metavar="FILE", help=_PUBKEY_HELP)
    e.set_defaults(run=cmd_eval)

    k = sub.add_parser("keygen", help="write a key pair that signs the daemon's bin maps",
                       description="Write a new Ed25519 key pair: DIR/signing__private_key "
                       "(mode 0600; the file the daemon reads from its secrets directory) and "
                       "DIR/binmap-signing.pub (for the clients), then print the next steps. "
                       "Existing keys are never overwritten.")
    k.add_argument("dir", metavar="DIR", help="directory for the two files (created if missing)")
    k.set_defaults(run=cmd_keygen)

    for name, (help_, run) in (commands or {}).items():
        s = sub.add_parser(name, help=help_, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(run=lambda a, run=run: run(a.rest))
    return ap


def main(argv: list[str] | None = None, *, commands: Commands | None = None) -> int:
    """Run ``lpcal ARGV``; ``commands`` adds commands that parse their own arguments (the
    daemon's, given by :func:`daemon.cli.main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = dict(commands or {})
    if argv and argv[0] in commands:  # their own parsers take every argument
        try:
            return int(commands[argv[0]][1](argv[1:]) or 0)
        except LpcalError as e:
            print(f"lpcal {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    if argv and argv[0] in DAEMON_COMMANDS:
        print(f"lpcal {argv[0]}: error: this command belongs to the daemon: run it with the "
              f"`lpcal` console script or `python -m daemon.cli {argv[0]}` (installed with "
              f"pip install 'lpcal[daemon]')", file=sys.stderr)
        return 2
    args = build_parser(commands).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except LpcalError as e:
        print(f"lpcal {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
