"""Paths and helpers shared by the deploy/ validation tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "k8s" / "base"
OVERLAYS = sorted(p for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
#: Kubernetes version the manifests are validated against (kubernetes-validate schemas).
K8S_VERSION = "1.30.0"


def real_kustomize() -> list[str] | None:
    """Command of a real kustomize (standalone or built into kubectl), if installed."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        probe = subprocess.run(["kubectl", "kustomize", "--help"], check=False,
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["kubectl", "kustomize"]
    return None
