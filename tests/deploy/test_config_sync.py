"""deploy/k8s/base/lpcal.toml is the ConfigMap source; kustomize cannot read files outside its
root, so it is a copy of config/lpcal.toml that must stay byte-identical.
Fix a failure with: cp config/lpcal.toml deploy/k8s/base/lpcal.toml"""

from __future__ import annotations

import tomllib

from .common import BASE, ROOT


def test_base_config_is_a_byte_identical_copy_of_config_lpcal_toml():
    source = ROOT / "config" / "lpcal.toml"
    copy = BASE / "lpcal.toml"
    assert source.is_file(), "config/lpcal.toml is missing"
    assert copy.read_bytes() == source.read_bytes(), (
        "deploy/k8s/base/lpcal.toml differs from config/lpcal.toml; run: "
        "cp config/lpcal.toml deploy/k8s/base/lpcal.toml")


def test_config_has_the_sections_the_deployment_relies_on():
    config = tomllib.loads((BASE / "lpcal.toml").read_text())
    assert {"kafka", "http", "defaults", "models"} <= set(config)
    assert config["http"].get("port", 8080) == 8080  # containerPort, probes, ServiceMonitor
