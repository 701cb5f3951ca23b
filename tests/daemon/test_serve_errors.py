"""``lpcal serve`` with its HTTP port taken: one line naming the setting, exit code 2.

The daemon opens its HTTP listener first (so probes answer during the broker checks); a port
in use used to end it with a 35-line traceback and exit code 1. Run as a user runs it: the
console script's module in a subprocess, a TOML file, the port held by another socket.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.support.daemon_harness import REPO, free_port


def test_serve_with_the_http_port_in_use_names_the_setting_and_exits_2(tmp_path):
    port = free_port()
    config = tmp_path / "lpcal.toml"
    config.write_text('[kafka]\nbootstrap_servers = "127.0.0.1:1"\n'
                      f'[http]\nhost = "127.0.0.1"\nport = {port}\n')
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        p = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--config",
                            str(config)], check=False, cwd=tmp_path, capture_output=True,
                           text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("lpcal serve:")]
    assert len(errors) == 1, p.stderr
    assert "http.port" in errors[0] and f"127.0.0.1:{port}" in errors[0], errors
    assert "address already in use" in errors[0].lower(), errors
