"""Fixtures of the deploy/ validation tests (manifests, rules, dashboard, Dockerfile)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from . import render
from .common import BASE, DEPLOY, OVERLAYS, ROOT


@pytest.fixture(scope="session")
def renderer():
    return render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Rendered objects of the base and of every overlay, keyed by directory (relative)."""
    return {str(p.relative_to(ROOT)): render.render(p) for p in [BASE, *OVERLAYS]}


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool, installing it with deploy/tools/ensure-promtool.sh when missing.
    Skips only when apt is impossible here (exit codes 2/3: no apt-get, not root)."""
    found = shutil.which("promtool")
    if found:
        return found
    script = DEPLOY / "tools" / "ensure-promtool.sh"
    # one install at a time: pytest-xdist workers (make test) would race for apt's lock
    with open(Path(tempfile.gettempdir()) / "lpcal-ensure-promtool.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(["sh", str(script)], check=False, capture_output=True,
                              text=True, timeout=900)
    if proc.returncode in (2, 3):
        pytest.skip(f"promtool unavailable and cannot be installed: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"ensure-promtool.sh failed ({proc.returncode}): {proc.stderr}"
    found = shutil.which("promtool")
    assert found, "ensure-promtool.sh succeeded but promtool is not on PATH"
    return found
