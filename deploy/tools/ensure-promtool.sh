#!/bin/sh
# Make sure `promtool` (Prometheus' rule checker) is on PATH.
# Idempotent and quiet: prints nothing and exits 0 when promtool already exists; otherwise
# installs the Debian package `prometheus` (it ships /usr/bin/promtool) with apt-get, which
# needs root (CI runs as root) or password-less sudo. apt's output is shown only on failure.
# Exit status: 0 promtool available; 2 no apt-get; 3 not root and no sudo; 4 install failed.
set -eu

if command -v promtool >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-promtool: promtool not found and apt-get is unavailable" >&2
    exit 2
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure-promtool: promtool not found and not root (cannot apt-get install)" >&2
        exit 3
    fi
fi

log="$(mktemp "${TMPDIR:-/tmp}/ensure-promtool.XXXXXX")"
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# The package's postinst may try to start a service; without an init system (containers) that
# step can fail harmlessly, so success is judged by promtool being on PATH afterwards.
$SUDO apt-get update -qq >"$log" 2>&1 || true
$SUDO apt-get install -y -qq --no-install-recommends prometheus >>"$log" 2>&1 || true

if command -v promtool >/dev/null 2>&1; then
    exit 0
fi
echo "ensure-promtool: installing the Debian package 'prometheus' did not provide promtool:" >&2
cat "$log" >&2
exit 4
