"""Small additions to :mod:`tests.support.daemon_harness` for the reliability suite.

* :class:`FastDaemon`: a :class:`~tests.support.daemon_harness.SubprocessDaemon` (the real
  ``lpcal serve``; its TOML from ``daemon_config`` sets 2 s consumer session timeouts, so a
  restart after SIGKILL does not wait ~10 s for the dead member to leave the group), with the
  logs of every incarnation;
* :func:`rss_kib`: resident memory of a process (``VmRSS`` of ``/proc/<pid>/status``);
* :func:`run_names`: topic names of one daemon run that shares the input topics of another;
* :func:`models_view`: ``GET /v1/models`` as ``{model: entry}``;
* :data:`FIGURES` / :func:`write_results`: figures of the tests (printed in the terminal
  summary; soak runs write them to ``docs/reliability.md``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import orjson

from tests.support.daemon_harness import SubprocessDaemon, TopicNames, http_get

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent.parent / "docs" / "reliability.md"
FIGURES: list[tuple[str, str, dict]] = []


class FastDaemon(SubprocessDaemon):
    """A subprocess ``lpcal serve`` (see the module docstring) with :meth:`all_logs`."""

    def all_logs(self) -> str:
        """Complete stdout+stderr of every incarnation."""
        parts = []
        for i in range(1, self.incarnation + 1):
            for suffix in (".out", ".err"):
                p = self._log(suffix, i)
                if p.exists():
                    parts.append(p.read_text("utf-8", "replace"))
        return "\n".join(parts)


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def run_names(base: TopicNames, run: str) -> TopicNames:
    """The input topics of ``base``; output/state topics of their own for the run ``run``."""
    stem = base.predictions.rsplit(".", 1)[0]
    return TopicNames(base.predictions, base.outcomes, f"{stem}.{run}.binmaps",
                      f"{stem}.{run}.dlq", f"{stem}.{run}.state")


async def models_view(url: str) -> dict[str, dict]:
    status, body = await http_get(url, "/v1/models", timeout=3.0)
    assert status == 200, (status, body[:300])
    return {e["model"]: e for e in orjson.loads(body)["models"]}


def write_figures(terminalreporter, entries) -> None:
    """Print ``entries`` (``(name, mode, values)``, values a dict or ``(key, value)`` pairs) in
    the terminal summary's "lpcal reliability figures" section (nothing when empty)."""
    if not entries:
        return
    terminalreporter.section("lpcal reliability figures")
    for name, mode, values in entries:
        terminalreporter.write_line(f"{name} [{mode}]:")
        for k, v in (values.items() if isinstance(values, dict) else values):
            terminalreporter.write_line(f"    {k}: {v}")


def record_figures(name: str, values: dict, soak: bool, command: str) -> None:
    """Print a test's figures, keep them for the terminal summary, and (soak) write them."""
    mode = "long (LPCAL_SOAK=1)" if soak else "short"
    FIGURES.append((name, mode, dict(values)))
    print(f"\nFIGURES {name} [{mode}]: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    if soak:
        write_results(name, values, command)


def write_results(name: str, values: dict, command: str) -> None:
    """Replace the section ``## name`` of ``docs/reliability.md`` with these figures (soak runs only)."""
    text = RESULTS.read_text() if RESULTS.exists() else (
        "# Reliability\n\n## Long runs\n\n"
        "Written by `make soak` (`LPCAL_SOAK=1 pytest -q tests/reliability -m soak`); each "
        "section is replaced when its test runs again.\n")
    body = [f"## {name}", "", f"On {os.cpu_count()} cores. Command: `{command}`", ""] + [f"- {k}: {v}" for k, v in values.items()] + [""]
    section = "\n".join(body) + "\n"
    pat = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    text = pat.sub(lambda _: section, text) if pat.search(text) else \
        text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


async def wait_settled(url: str, expected: dict[str, int], timeout: float,
                       quiet: float = 4.0) -> dict[str, dict]:
    """Poll ``/v1/models`` until every model of ``expected`` has at least that many joined
    samples and no fit in flight, or until nothing changed for ``quiet`` seconds while every
    model of ``expected`` is on this replica, none has epochs waiting for a fit and ``/readyz``
    is 200 (a daemon that lost samples never reaches ``expected``: measure it instead of timing
    out; a replica still waiting for a partition, e.g. held by a killed member the broker has
    not expired yet, is not "quiet"). Returns the last view; raises only if the daemon never
    answered."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    last_key, since, view = None, time.monotonic(), {}
    while time.monotonic() < deadline:
        try:
            view = await models_view(url)
        except Exception:  # noqa: BLE001 - restarting / not serving yet
            await asyncio.sleep(0.5)
            continue
        busy = any(e["fit_in_flight"] or e.get("epochs_waiting") for e in view.values())
        key = tuple(sorted((m, e["samples_total"]) for m, e in view.items()))
        if not busy and all(m in view and view[m]["samples_total"] >= n
                            for m, n in expected.items()):
            return view
        if not busy and set(expected) <= set(view):
            try:
                status, _ = await http_get(url, "/readyz", timeout=3.0)
            except Exception:  # noqa: BLE001 - not answering: not settled
                status = None
            busy = status != 200
        if key != last_key or busy:
            last_key, since = key, time.monotonic()
        elif time.monotonic() - since >= quiet and set(expected) <= set(view):
            return view
        await asyncio.sleep(0.5)
    if not view:
        raise AssertionError(f"{url}/v1/models never answered")
    return view
