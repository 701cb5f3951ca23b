"""``lpcal serve`` and ``lpcal simulate`` (dispatched here by :mod:`lpcal.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def serve(argv: list[str]) -> int:
    from daemon.service import Daemon
    from daemon.settings import SettingsError, load_settings

    ap = argparse.ArgumentParser(prog="lpcal serve", description="run the calibration daemon")
    ap.add_argument("--config", help="TOML settings file (default: $LPCAL_CONFIG or "
                                     "config/lpcal.toml)")
    a = ap.parse_args(argv)
    try:
        settings = load_settings(a.config)
    except SettingsError as e:
        print(f"lpcal serve: invalid settings:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in settings.signing.warnings():
        logging.getLogger("lpcal.daemon").warning("%s", warning)
    asyncio.run(Daemon(settings).serve())
    return 0


def main(command: str, argv: list[str]) -> int:
    if command == "serve":
        return serve(argv)
    if command == "simulate":
        from daemon.simulate import main as simulate_main

        return simulate_main(argv)
    raise SystemExit(f"unknown daemon command {command!r}")
