"""Fixtures shared by every suite that talks to a real embedded Kafka broker (Tansu, memory storage).

* ``broker`` (session): one :class:`daemon.tools.embedded_broker.EmbeddedBroker` on a free loopback
  port for the whole run (integration and reliability tests alike); its log tail is attached to
  the report of a failing test. Tests must NOT restart it (memory storage: a restart loses every
  topic); a test that needs an outage starts its own broker.
* ``topic_prefix`` (function): a unique, Kafka-legal prefix per test (``it-`` for integration,
  ``rel-`` for reliability tests), so tests sharing the broker never see each other's topics or
  consumer groups.
"""

from __future__ import annotations

import re
import uuid

import pytest

from daemon.tools.embedded_broker import EmbeddedBroker

_SUITE_PREFIX = {"integration": "it", "reliability": "rel"}


@pytest.fixture(scope="session")
def broker():
    b = EmbeddedBroker()
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


#: Suites whose every test starts a daemon or talks to the broker: marked ``slow``.
_SLOW_SUITES = ("integration", "reliability")


def pytest_collection_modifyitems(config, items):
    """Mark the broker suites ``slow``, so ``pytest -m 'not slow'`` is the quick loop."""
    for item in items:
        if item.path.parent.name in _SLOW_SUITES:
            item.add_marker(pytest.mark.slow)
