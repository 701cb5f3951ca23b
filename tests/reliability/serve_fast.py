"""``lpcal serve --config FILE`` with short consumer-group timeouts (a subprocess entry point).

Identical to :func:`daemon.cli.serve` except that the daemon's consumer gets
``session_timeout_ms=2000, heartbeat_interval_ms=200`` (``Daemon(consumer_options=...)``):
the settings do not expose these yet, and with aiokafka's defaults (10 s / 3 s) every restart
after a SIGKILL waits ~10 s for the dead member to be expelled from the group. Run by path
(``python tests/reliability/serve_fast.py --config X``), so it needs only the installed
``lpcal``/``daemon`` packages.

Diagnostics only: ``RELIABILITY_PATCH=assign`` in the environment applies the fix proposed for
the assignment race found by the crash-safety test (pause newly assigned partitions while
``Daemon.on_assigned`` restores state, resume after its seeks), to check that the fix
suffices. Never set by ``make test`` or ``make soak``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

FAST_CONSUMER = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 200}


def _patch_assign(daemon_cls) -> None:
    """Pause newly assigned partitions during ``on_assigned`` (the proposed fix)."""
    original = daemon_cls.on_assigned

    async def on_assigned(self, tps):
        new = [tp for tp in tps if tp not in self.assigned]
        if new:
            self.consumer.pause(*new)
        try:
            await original(self, tps)
        finally:
            if new:
                self.consumer.resume(*new)

    daemon_cls.on_assigned = on_assigned


def main(argv: list[str] | None = None) -> int:
    import os

    from daemon.service import Daemon

    if "assign" in os.environ.get("RELIABILITY_PATCH", "").split(","):
        _patch_assign(Daemon)
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
