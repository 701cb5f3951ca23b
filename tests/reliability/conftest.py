"""Fixtures of the reliability suite: short versions in ``make test``, long versions
with ``LPCAL_SOAK=1`` (``make soak`` runs ``pytest -m soak`` with it).

* ``soak`` (session): True when ``LPCAL_SOAK=1``; tests size themselves from it;
* ``broker`` and ``topic_prefix`` come from ``tests/conftest.py`` (one session broker for all
  suites; the outage test starts its own);
* ``figures``: ``figures("name", {...})`` records a test's measured figures: they are printed
  in the terminal summary of every run (``-q`` included) and, in a soak run, written to
  ``docs/reliability.md`` (see :mod:`tests.support.reliability`).
"""

from __future__ import annotations

import os

import pytest

from tests.support.reliability import FIGURES, record_figures, write_figures

SOAK = os.environ.get("LPCAL_SOAK", "") == "1"


@pytest.fixture(scope="session")
def soak() -> bool:
    return SOAK


@pytest.fixture
def figures(request, soak):
    def record(name: str, values: dict, command: str | None = None) -> None:
        record_figures(name, values, soak, command or f"make soak  # {request.node.nodeid}")
    return record


def pytest_terminal_summary(terminalreporter):
    write_figures(terminalreporter, FIGURES)
