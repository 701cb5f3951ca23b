"""Fixtures shared by the daemon's unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No stray LPCAL_* variables, no default config file, an empty secrets dir."""
    for key in list(os.environ):
        if key.upper().startswith("LPCAL_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    monkeypatch.setenv("LPCAL_SECRETS_DIR", str(secrets))
    return tmp_path
