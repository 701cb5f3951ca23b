"""Pytest fixtures of the broker suites (registered in ``tests/conftest.py``).

* ``deployment``: one test's slice of the session's embedded broker: unique topic names, their
  creation, a daemon config and its settings (:class:`Deployment`), instead of the same five
  harness calls at the top of every broker test.

Usage::

    async def test_something(deployment):
        names = await deployment.topics(partitions=2)
        settings = deployment.settings(deployment.config(partitions=2, defaults={"k": 3}))
        async with running_daemon(settings) as rd:
            ...
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.settings import Settings
from tests.support.daemon_harness import (
    TopicNames,
    build_settings,
    create_topics,
    daemon_config,
    free_port,
)


@dataclass
class Deployment:
    """The broker, this test's topic names and a folder for its config files."""

    bootstrap: str
    names: TopicNames
    tmp_path: Path

    async def topics(self, partitions: int = 1, names: TopicNames | None = None
                     ) -> TopicNames:
        """Create ``names`` (default: this test's) with ``partitions`` input partitions."""
        names = names or self.names
        await create_topics(self.bootstrap, names, partitions)
        return names

    def config(self, *, names: TopicNames | None = None, http_port: int | None = None,
               **kw: Any) -> dict[str, Any]:
        """:func:`~tests.support.daemon_harness.daemon_config` of this broker and ``names``
        (default: this test's), on a free HTTP port unless ``http_port``."""
        return daemon_config(self.bootstrap, names or self.names,
                             http_port=free_port() if http_port is None else http_port, **kw)

    def settings(self, cfg: dict[str, Any], name: str = "lpcal") -> Settings:
        """The settings of ``cfg``, loaded from a TOML file like ``lpcal serve --config``."""
        return build_settings(cfg, self.tmp_path, name)


@pytest.fixture
def deployment(broker, topic_prefix, tmp_path) -> Deployment:
    return Deployment(broker.bootstrap, TopicNames.for_prefix(topic_prefix), tmp_path)
