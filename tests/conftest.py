"""Fixtures shared by every suite that talks to a real embedded Kafka broker (Tansu, memory storage).

* ``broker`` (session): one :class:`daemon.tools.embedded_broker.EmbeddedBroker` on a free loopback
  port for the whole run (integration and reliability tests alike); its log tail is attached to
  the report of a failing test. Tests must NOT restart it (memory storage: a restart loses every
  topic); a test that needs an outage starts its own broker.
* ``topic_prefix`` (function): a unique, Kafka-legal prefix per test (``it-`` for integration,
  ``rel-`` for reliability tests), so tests sharing the broker never see each other's topics or
  consumer groups;
* ``deployment`` (function, :mod:`tests.support.fixtures`): the broker, this test's topics, a
  daemon config and its settings.

Under pytest-xdist (``make test`` runs all but the ``serial`` tests with ``-n 2 --dist
loadscope``, then the ``serial`` ones in a plain run) every worker has its own session broker,
the modules are ordered for the workers (see :func:`pytest_collection_modifyitems`), and the
figures the reliability tests record (:func:`tests.support.reliability.record_figures`) travel
from the workers to the controller in the reports' ``user_properties``, to be printed in the
terminal summary as in a run without xdist.
"""

from __future__ import annotations

import os
import re
import sys
import uuid

import pytest

from daemon.tools.embedded_broker import EmbeddedBroker

pytest_plugins = ["tests.support.fixtures"]

_SUITE_PREFIX = {"integration": "it", "reliability": "rel"}


@pytest.fixture(scope="session")
def broker():
    # Tansu does not exit on SIGTERM while clients hold connections: EmbeddedBroker.stop()
    # then waits ``stop_timeout`` before its SIGKILL. At the end of the session that wait (5 s
    # by default) buys nothing (memory storage, everything is discarded), so SIGKILL sooner.
    b = EmbeddedBroker(stop_timeout=0.5)
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def topic_prefix(request) -> str:
    suite = _SUITE_PREFIX.get(request.node.path.parent.name, "t")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:50].strip("-")
    return f"{suite}-{name}-{uuid.uuid4().hex[:8]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and "broker" in getattr(item, "fixturenames", ()):
        b = item.funcargs.get("broker")
        if b is not None:
            rep.sections.append(("embedded broker", f"{b!r}\n{b.log_tail(2000)}"))
    if _is_xdist_worker(item.config):
        _attach_new_figures(rep)


# --------------------------------------------------------------------------- pytest-xdist

_FIGURES_KEY = "lpcal_figures"
_figures_sent = 0                        # worker: FIGURES entries already attached to a report
_worker_figures: list[tuple[str, str, list]] = []  # controller: figures received from workers


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _attach_new_figures(rep) -> None:
    """Worker: figures recorded since the last report go to the controller with this one
    (values as text: what the summary prints, and always serializable)."""
    global _figures_sent
    harness = sys.modules.get("tests.support.reliability")
    figures = getattr(harness, "FIGURES", ())
    for name, mode, values in figures[_figures_sent:]:
        rep.user_properties.append(
            (_FIGURES_KEY, (name, mode, [(str(k), str(v)) for k, v in values.items()])))
    _figures_sent = len(figures)


def pytest_runtest_logreport(report):
    """Controller: collect the figures the workers attached (see :func:`_attach_new_figures`);
    without xdist no report carries any (tests/reliability/conftest.py prints them)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker sees its own reports here too
        return
    for key, value in report.user_properties:
        if key == _FIGURES_KEY:
            _worker_figures.append(value)


def pytest_terminal_summary(terminalreporter):
    from tests.support.reliability import write_figures

    write_figures(terminalreporter, _worker_figures)


#: Suites whose every test starts a daemon or talks to the broker: marked ``slow``.
_SLOW_SUITES = ("integration", "reliability")


def pytest_collection_modifyitems(config, items):
    """Mark the broker suites ``slow``, so ``pytest -m 'not slow'`` is the quick loop.

    Under xdist, also order the modules: ``--dist loadscope`` hands modules out by decreasing
    number of tests and, among modules with as many tests, in collection order. Most long
    modules (the broker suites) have one test or a few: put them before the others, so that
    short modules even out the end of the run. Without xdist the order is unchanged."""
    for item in items:
        if item.path.parent.name in _SLOW_SUITES:
            item.add_marker(pytest.mark.slow)
    if _is_xdist_worker(config):
        # stable: each module stays whole, in its order
        items.sort(key=lambda item: item.path.parent.name not in _SLOW_SUITES)
