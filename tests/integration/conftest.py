"""Fixtures of the integration tests: a real embedded Kafka broker (Tansu, memory storage).

* ``broker`` (session): one :class:`daemon.embedded_broker.EmbeddedBroker` on a free loopback
  port for the whole run; its log path is printed when a test fails (see the report section).
  Tests must NOT restart it (memory storage: a restart loses every topic); a test that needs
  an outage starts its own broker.
* ``topic_prefix`` (function): a unique, Kafka-legal prefix per test, so tests sharing the
  session broker never see each other's topics or consumer groups.
"""

from __future__ import annotations

import re
import uuid

import pytest

from daemon.embedded_broker import EmbeddedBroker


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
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:60].strip("-")
    return f"it-{name}-{uuid.uuid4().hex[:8]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and "broker" in getattr(item, "fixturenames", ()):
        b = item.funcargs.get("broker")
        if b is not None:
            rep.sections.append(("embedded broker", f"{b!r}\n{b.log_tail(2000)}"))
