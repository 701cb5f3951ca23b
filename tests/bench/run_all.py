"""Run every lpcal benchmark and print the result tables in Markdown (entry point of `make bench`).

    python -m tests.bench.run_all            # full run; writes docs/benchmarks.md
    python -m tests.bench.run_all --quick    # tiny inputs, a smoke run (writes nothing by default)
    python -m tests.bench.run_all --only fit,apply     # reruns two; their sections only
    python -m tests.bench.run_all --only fit,apply --out /tmp/results.md

Benchmarks: ``fit`` (fit time from raw arrays and from pools), ``online_calls`` (the online
calibrator's cost per call and per sample, by batch size), ``apply`` (apply throughput),
``quality`` (CIFAR records), ``variants`` (split vs shared pools, theory vs practical sizing),
``directions`` (the design directions b and d against the default), ``scale`` (1 replica
against 2, failover with a 10,000-model state topic), ``certificate`` (coverage, tightness and
certification rate of the held-out bound on truth-known families, the selection rule, its cost),
``eps`` (Err_p against top-label ECE on the CIFAR records: what eps means, per k), ``drift`` (the
change test's detection delay and false alarms on real networks, against the Err_p threshold),
``models`` (ingest from 1 to 10,000 models against a raw reader, bytes per idle model),
``recovery`` (samples to a good map at the start and after a drift: the online loop of
:mod:`lpcal.online` against the fixed epoch schedule and temperature scaling), ``checkpoint``
(a model's checkpoint encode and decode time and bytes against the previous format's encoder).
Every timing is a ratio against a baseline measured in the same process (see
:mod:`tests.bench.common`).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.bench import (
    bench_apply,
    bench_certificate,
    bench_checkpoint,
    bench_directions,
    bench_drift,
    bench_eps,
    bench_families,
    bench_fit,
    bench_ingest,
    bench_models,
    bench_online_calls,
    bench_quality,
    bench_recovery,
    bench_scale,
    bench_variants,
)
from tests.bench.common import Table


class _MarkdownBench:
    """Adapts a benchmark whose ``run`` returns finished Markdown (the ingest benchmark)."""

    @dataclass
    class _Text:
        text: str
        key: str

        def to_markdown(self) -> str:
            return self.text.rstrip() + "\n"

    def __init__(self, module, key: str):
        self.module, self.key = module, key

    def run(self, quick: bool = False) -> list:
        return [self._Text(self.module.run(quick=quick), self.key)]


BENCHMARKS = {
    "fit": bench_fit,
    "online_calls": bench_online_calls,
    "apply": bench_apply,
    "quality": bench_quality,
    "variants": bench_variants,
    "ingest": _MarkdownBench(bench_ingest, "ingest"),
    "directions": bench_directions,
    "scale": bench_scale,
    "certificate": bench_certificate,
    "eps": bench_eps,
    "drift": bench_drift,
    "models": bench_models,
    "recovery": bench_recovery,
    "families": bench_families,
    "checkpoint": bench_checkpoint,
}
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def run_benchmarks(names: list[str], quick: bool, log=print
                   ) -> tuple[dict[str, list[Table]], dict[str, float]]:
    """Run the named benchmarks; return the tables and the wall time of each, by name."""
    tables: dict[str, list[Table]] = {}
    walls: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        log(f"[bench] {name} ...")
        tables[name] = list(BENCHMARKS[name].run(quick=quick))
        walls[name] = time.perf_counter() - t0
        log(f"[bench] {name} done in {walls[name]:.1f} s")
    return tables, walls


_SECTION = re.compile(r"^<!-- bench:(?P<name>[a-z_]+) -->\n.*?^<!-- /bench:(?P=name) -->\n",
                      re.DOTALL | re.MULTILINE)


def render_section(name: str, tables: list[Table], wall: float, command: str,
                   quick: bool) -> str:
    """One benchmark's tables between markers, so a later ``--only`` run replaces just them."""
    smoke = " (quick smoke run: tiny inputs, not representative)" if quick else ""
    head = [f"<!-- bench:{name} -->", f"## {name}", "",
            f"`{command}`{smoke}; wall time {wall:.0f} s.", ""]
    return "\n".join(head) + "\n" + "\n".join(t.to_markdown() for t in tables) + \
        f"<!-- /bench:{name} -->\n"


def render(sections: dict[str, str], previous: str | None = None) -> str:
    """The whole page: the header, then every benchmark's section in :data:`BENCHMARKS` order;
    sections not rerun are kept from ``previous`` (the page as it was)."""
    kept = {m.group("name"): m.group(0) for m in _SECTION.finditer(previous or "")}
    kept.update(sections)
    head = [
        "# Benchmarks",
        "",
        ("Written by `make bench`; do not edit by hand (the narrative is in "
         "[library.md](library.md#quality-on-real-predictions), [daemon.md](daemon.md) and "
         "[scaling.md](scaling.md)). `python -m tests.bench.run_all --only NAME` reruns one "
         "benchmark and replaces its section only."),
        "",
        (f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
         f"{platform.python_version()}, numpy {np.__version__} (shared machine: wall times are "
         "noisy; the ratios to a baseline measured in the same process are the headline)."),
        "",
    ]
    order = [n for n in BENCHMARKS if n in kept]
    return "\n".join(head) + "\n" + "\n".join(kept[n] for n in order)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.run_all", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny inputs (smoke run)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {list(BENCHMARKS)}")
    ap.add_argument("--out", default=None,
                    help=f"Markdown output file (default: {RESULTS} for a full run, none with "
                         "--quick)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    command = "python -m tests.bench.run_all" + (" " + " ".join(argv if argv is not None
                                                                else sys.argv[1:])).rstrip()
    tables, walls = run_benchmarks(names, args.quick, log=lambda m: print(m, file=sys.stderr,
                                                                          flush=True))
    sections = {n: render_section(n, tables[n], walls[n], command, args.quick) for n in names}
    print("\n".join(sections.values()))
    out = args.out if args.out is not None else (None if args.quick else str(RESULTS))
    if out:
        path = Path(out)
        previous = path.read_text(encoding="utf-8") if path.exists() else None
        path.write_text(render(sections, previous), encoding="utf-8")
        print(f"[bench] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
