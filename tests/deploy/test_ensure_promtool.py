"""deploy/tools/ensure-promtool.sh: quiet no-op when promtool exists, clear exit codes."""

from __future__ import annotations

import os
import shutil
import subprocess

from .common import DEPLOY

SCRIPT = DEPLOY / "tools" / "ensure-promtool.sh"


def run_with_path(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("sh"), str(SCRIPT)], check=False, capture_output=True,
                          text=True, timeout=60, env={"PATH": path, "HOME": os.environ["HOME"]})


def make_bin(tmp_path, tools: dict[str, str]) -> str:
    """A PATH with only the POSIX tools the script needs, plus fakes from ``tools``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("sh", "id", "cat", "rm", "mktemp"):
        if name not in tools:  # never write through a symlink to a system binary
            (bindir / name).symlink_to(shutil.which(name))
    for name, body in tools.items():
        fake = bindir / name
        assert not fake.exists() and not fake.is_symlink()
        fake.write_text(f"#!{shutil.which('sh')}\n{body}\n")
        fake.chmod(0o755)
    return str(bindir)


def test_noop_and_silent_when_promtool_exists(tmp_path):
    path = make_bin(tmp_path, {"promtool": "exit 0", "apt-get": "echo CALLED >&2; exit 1"})
    proc = run_with_path(path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_exit_2_without_apt(tmp_path):
    proc = run_with_path(make_bin(tmp_path, {}))
    assert proc.returncode == 2
    assert "apt-get is unavailable" in proc.stderr


def test_exit_4_and_shows_apt_output_when_install_does_not_provide_promtool(tmp_path):
    fake_apt = 'echo "E: Unable to locate package prometheus" >&2; exit 100'
    proc = run_with_path(make_bin(tmp_path, {"apt-get": fake_apt, "id": "echo 0"}))
    assert proc.returncode == 4
    assert "Unable to locate package prometheus" in proc.stderr
