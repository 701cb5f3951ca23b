"""``lpcal serve --config FILE`` with short consumer-group timeouts (a subprocess entry point).

Identical to :func:`daemon.cli.serve` except that the daemon's consumer gets
``session_timeout_ms=2000, heartbeat_interval_ms=200`` (``Daemon(consumer_options=...)``):
the settings do not expose these yet, and with aiokafka's defaults (10 s / 3 s) every restart
after a SIGKILL waits ~10 s for the dead member to be expelled from the group. Run by path
(``python tests/reliability/serve_fast.py --config X``), so it needs only the installed
``lpcal``/``daemon`` packages.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

FAST_CONSUMER = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 200}


def main(argv: list[str] | None = None) -> int:
    from daemon.service import Daemon
    from daemon.settings import SettingsError, load_settings

    ap = argparse.ArgumentParser(prog="serve_fast")
    ap.add_argument("--config", required=True)
    a = ap.parse_args(argv)
    try:
        settings = load_settings(a.config)
    except SettingsError as e:
        print(f"serve_fast: invalid settings:\n{e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(Daemon(settings, consumer_options=dict(FAST_CONSUMER)).serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
