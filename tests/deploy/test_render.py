"""Tests of the tiny kustomize renderer (tests/deploy/render.py) and, when a real kustomize is
installed, byte-for-byte semantic agreement with it on deploy/k8s."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from .common import BASE, OVERLAYS, ROOT, real_kustomize


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


DEPLOYMENT = """\
    apiVersion: apps/v1
    kind: Deployment
    metadata: {name: web}
    spec:
      selector: {matchLabels: {app: web}}
      template:
        metadata: {labels: {app: web}}
        spec:
          containers:
            - name: web
              image: registry.local:5000/team/web:1.0
              args: [--a]
              env:
                - {name: A, value: "1"}
                - {name: B, value: "2"}
              volumeMounts:
                - {name: cfg, mountPath: /cfg}
          volumes:
            - name: cfg
              configMap: {name: web-config}
"""


@pytest.mark.parametrize(
    "data, expected",
    [
        # vectors from kustomize api/hasher/hasher_test.go (TestConfigMapHash)
        (None, "6ct58987ht"),
        ({"one": ""}, "9g67k2htb6"),
        ({"two": 2, "one": "", "three": 3}, "7757f9kkct"),
    ],
)
def test_hash_matches_kustomize_vectors(renderer, data, expected):
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "whatever"}}
    if data is not None:
        cm["data"] = data
    assert renderer.kustomize_hash(cm) == expected


def test_generator_patch_namespace_labels_images(renderer, tmp_path):
    write(tmp_path, {
        "base/kustomization.yaml": """\
            resources: [deploy.yaml]
            commonLabels: {team: x}
            configMapGenerator:
              - name: web-config
                files: [app.toml, renamed.toml=other.toml]
            """,
        "base/deploy.yaml": DEPLOYMENT,
        "base/app.toml": "a = 1\n",
        "base/other.toml": "b = 2\n",
        "ov/kustomization.yaml": """\
            namespace: prod
            resources: [../base]
            images:
              - {name: registry.local:5000/team/web, newName: ghcr.io/o/web, newTag: "2.0"}
            patches:
              - path: p.yaml
            """,
        "ov/p.yaml": """\
            apiVersion: apps/v1
            kind: Deployment
            metadata: {name: web}
            spec:
              replicas: 3
              template:
                spec:
                  containers:
                    - name: web
                      args: [--b]
                      env:
                        - {name: C, value: "3"}
                        - {name: A, value: "9"}
                    - name: side
                      image: busybox:1.36
            """,
    })
    objs = {o["kind"]: o for o in renderer.render(tmp_path / "ov")}
    cm, dep = objs["ConfigMap"], objs["Deployment"]
    assert cm["data"] == {"app.toml": "a = 1\n", "renamed.toml": "b = 2\n"}
    assert cm["metadata"]["name"] == f"web-config-{renderer.kustomize_hash(cm)}"
    assert cm["metadata"]["namespace"] == dep["metadata"]["namespace"] == "prod"
    spec = dep["spec"]["template"]["spec"]
    assert spec["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"]["matchLabels"] == {"app": "web", "team": "x"}
    assert dep["spec"]["template"]["metadata"]["labels"] == {"app": "web", "team": "x"}
    web, side = spec["containers"]
    assert [c["name"] for c in spec["containers"]] == ["web", "side"]  # patch order first
    assert web["args"] == ["--b"]  # plain lists are replaced
    assert web["env"] == [{"name": "C", "value": "3"}, {"name": "A", "value": "9"},
                          {"name": "B", "value": "2"}]
    assert web["image"] == "ghcr.io/o/web:2.0"
    assert side["image"] == "busybox:1.36"
    assert web["volumeMounts"] == [{"name": "cfg", "mountPath": "/cfg"}]
    assert_same_as_real_kustomize(renderer, tmp_path / "ov")


def test_selector_labels_reach_spread_constraints_and_network_policy_peers(renderer, tmp_path):
    """kustomize's create-false field specs: with includeSelectors the labels go into
    existing matchLabels of topologySpreadConstraints, pod (anti-)affinity terms and a
    NetworkPolicy's podSelector and peers, never into matchExpressions, and nothing is created
    where no matchLabels exist."""
    write(tmp_path, {
        "kustomization.yaml": """\
            resources: [deploy.yaml, netpol.yaml]
            labels:
              - pairs: {team: x}
                includeSelectors: true
            """,
        "deploy.yaml": DEPLOYMENT.replace("""\
          containers:""", """\
          topologySpreadConstraints:
            - {maxSkew: 1, topologyKey: zone, whenUnsatisfiable: ScheduleAnyway,
               labelSelector: {matchLabels: {app: web}}}
            - {maxSkew: 1, topologyKey: host, whenUnsatisfiable: ScheduleAnyway,
               labelSelector: {matchExpressions: [{key: app, operator: Exists}]}}
          affinity:
            podAntiAffinity:
              preferredDuringSchedulingIgnoredDuringExecution:
                - weight: 1
                  podAffinityTerm: {topologyKey: host, labelSelector: {matchLabels: {app: web}}}
          containers:"""),
        "netpol.yaml": """\
            apiVersion: networking.k8s.io/v1
            kind: NetworkPolicy
            metadata: {name: web}
            spec:
              podSelector: {matchLabels: {app: web}}
              ingress:
                - from:
                    - podSelector: {matchLabels: {role: scraper}}
                    - podSelector: {matchExpressions: [{key: role, operator: In, values: [c]}]}
                      namespaceSelector: {matchLabels: {env: prod}}
            """,
    })
    objs = {o["kind"]: o for o in renderer.render(tmp_path)}
    spec = objs["Deployment"]["spec"]["template"]["spec"]
    zone, host = spec["topologySpreadConstraints"]
    assert zone["labelSelector"] == {"matchLabels": {"app": "web", "team": "x"}}
    assert host["labelSelector"] == {"matchExpressions": [{"key": "app", "operator": "Exists"}]}
    (term,) = spec["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {"app": "web", "team": "x"}
    netpol = objs["NetworkPolicy"]
    assert netpol["metadata"]["labels"] == {"team": "x"}
    assert netpol["spec"]["podSelector"]["matchLabels"] == {"app": "web", "team": "x"}
    scraper, client = netpol["spec"]["ingress"][0]["from"]
    assert scraper["podSelector"]["matchLabels"] == {"role": "scraper", "team": "x"}
    assert "matchLabels" not in client["podSelector"]
    assert client["namespaceSelector"] == {"matchLabels": {"env": "prod"}}
    assert_same_as_real_kustomize(renderer, tmp_path)


def test_null_in_patch_deletes_a_field(renderer, tmp_path):
    write(tmp_path, {
        "kustomization.yaml": "resources: [d.yaml]\npatches:\n  - patch: |\n"
        "      apiVersion: apps/v1\n      kind: Deployment\n      metadata: {name: web}\n"
        "      spec: {selector: null}\n",
        "d.yaml": DEPLOYMENT,
    })
    (dep,) = renderer.render(tmp_path)
    assert "selector" not in dep["spec"]
    assert_same_as_real_kustomize(renderer, tmp_path)


@pytest.mark.parametrize(
    "files, error, match",
    [
        ({"kustomization.yaml": "resources: [d.yaml]\nnamePrefix: x-\n"},
         "UnsupportedFeature", "namePrefix"),
        ({"kustomization.yaml": "resources: [../outside.yaml]\n"}, "RenderError", "outside"),
        ({"kustomization.yaml": "resources: [missing.yaml]\n"}, "RenderError", "does not exist"),
        ({"kustomization.yaml": "resources: [d.yaml]\npatches:\n  - patch: |\n"
          "      apiVersion: apps/v1\n      kind: Deployment\n      metadata: {name: nope}\n"},
         "RenderError", "matches no resource"),
        ({"kustomization.yaml": "resources: [d.yaml]\npatches:\n  - patch: |\n"
          "      - op: replace\n        path: /spec/replicas\n        value: 2\n"
          "    target: {kind: Deployment}\n"},
         "UnsupportedFeature", "JSON6902"),
        ({"kustomization.yaml": "resources: [d.yaml]\nconfigMapGenerator:\n"
          "  - name: c\n    literals: [a=b]\n"}, "UnsupportedFeature", "literals"),
        ({"kustomization.yaml": "resources: [d.yaml]\npatches:\n  - patch: |\n"
          "      apiVersion: apps/v1\n      kind: Deployment\n      metadata: {name: web}\n"
          "      spec: {template: {spec: {containers: [{name: web, $patch: delete}]}}}\n"},
         "UnsupportedFeature", "directive"),
    ],
)
def test_unsupported_or_invalid_input_raises(renderer, tmp_path, files, error, match):
    write(tmp_path / "k", {"d.yaml": DEPLOYMENT, **files})
    (tmp_path / "outside.yaml").write_text(textwrap.dedent(DEPLOYMENT))
    with pytest.raises(getattr(renderer, error), match=match):
        renderer.render(tmp_path / "k")


def test_cli_prints_yaml(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deploy.render", str(BASE)], cwd=ROOT,
        capture_output=True, text=True, check=True)
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget",
                     "Service", "ServiceAccount"]


def _key(obj):
    return (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])


def assert_same_as_real_kustomize(renderer, path: Path) -> None:
    """Compare with a real kustomize if one is installed (no-op otherwise)."""
    cmd = real_kustomize()
    if cmd is None:
        return
    proc = subprocess.run([*cmd, str(path)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(proc.stdout) if o}
    ours = {_key(o): o for o in renderer.render(path)}
    assert ours.keys() == theirs.keys()
    for key, obj in ours.items():
        assert obj == theirs[key], key


@pytest.mark.parametrize("path", [BASE, *OVERLAYS], ids=lambda p: p.name)
def test_matches_real_kustomize_when_available(renderer, path):
    cmd = real_kustomize()
    if cmd is None:
        pytest.skip("no kustomize or kubectl on PATH; the renderer is checked by the unit "
                    "tests above and kustomize's own hash vectors")
    proc = subprocess.run([*cmd, str(path)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(proc.stdout) if o}
    ours = {_key(o): o for o in renderer.render(path)}
    assert ours.keys() == theirs.keys()
    for key, obj in ours.items():
        assert obj == theirs[key], key
