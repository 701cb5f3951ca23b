"""The ``lpcal`` console script (``[project.scripts]`` in ``pyproject.toml``).

It runs the commands of the daemon and its tools, each importing its modules only when it runs:

* ``lpcal serve``: the calibration daemon (:mod:`daemon.service`; the ``daemon`` extra);
* ``lpcal simulate``: synthetic traffic into Kafka (:mod:`daemon.tools.simulate`; ``daemon``);
* ``lpcal broker``: the embedded Kafka broker for development, in the foreground
  (:mod:`daemon.tools.embedded_broker`; the ``broker`` extra).

Every other command (``fit``, ``apply``, ``eval``, ``keygen``, ``--help``) goes to
:func:`lpcal.cli.main`, the library's command line, which imports nothing from ``daemon``. A
missing extra is a one-line error naming it (exit 2), as is every invalid setting and a broker
that does not fit the settings (an idempotent producer refused, missing topics).

``python -m daemon.cli ARGS`` is the same as ``lpcal ARGS``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from lpcal.cli import main as lpcal_main
from lpcal.errors import LpcalError


def _needs(command: str, extra: str, e: ImportError) -> LpcalError:
    return LpcalError(f"'lpcal {command}' needs the {extra} extra: pip install "
                      f"'lpcal[{extra}]' ({e})")


def serve(argv: list[str]) -> int:
    try:
        from daemon.checkpoint.store import RecordLimitError
        from daemon.kafka.clients import BrokerSettingsError
        from daemon.kafka.topics import TopicLayoutError
        from daemon.service import Daemon
        from daemon.settings import SettingsError, load_settings
    except ImportError as e:
        raise _needs("serve", "daemon", e) from None

    ap = argparse.ArgumentParser(prog="lpcal serve", description="run the calibration daemon")
    ap.add_argument("--config", help="TOML settings file (default: $LPCAL_CONFIG or "
                                     "config/lpcal.toml)")
    a = ap.parse_args(argv)
    try:
        settings = load_settings(a.config)
    except SettingsError as e:
        # the message has its own "invalid settings (N problems):" header, except for a
        # config file that cannot be read
        text = str(e)
        print(f"lpcal serve: {text}" if text.startswith("invalid settings")
              else f"lpcal serve: invalid settings: {text}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in settings.signing.warnings():
        logging.getLogger("lpcal.daemon").warning("%s", warning)
    try:
        asyncio.run(Daemon(settings).serve())
    except (BrokerSettingsError, TopicLayoutError, RecordLimitError) as e:
        # the broker does not fit the settings: the message names what to change
        print(f"lpcal serve: error: {e}", file=sys.stderr)
        return 2
    return 0


def simulate(argv: list[str]) -> int:
    try:
        from daemon.tools.simulate.cli import main as simulate_main
    except ImportError as e:
        raise _needs("simulate", "daemon", e) from None
    return simulate_main(argv)


def broker(argv: list[str]) -> int:
    from daemon.tools.embedded_broker import main as broker_main  # stdlib only

    return broker_main(argv)


#: The daemon's commands, as :func:`lpcal.cli.main` takes them (listed in ``lpcal --help``).
COMMANDS = {
    "serve": ("run the calibration daemon", serve),
    "simulate": ("play miscalibrated models into Kafka", simulate),
    "broker": ("run the embedded Kafka broker for development (Ctrl-C stops it)", broker),
}


def main(argv: list[str] | None = None) -> int:
    """``lpcal ARGV``: the daemon's commands here, every other one in :mod:`lpcal.cli`."""
    return lpcal_main(argv, commands=COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
