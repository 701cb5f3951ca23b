"""Rendered Kubernetes manifests: schema validation (kubernetes-validate, pinned version),
security posture, probes, secrets, volumes, wiring between objects, and the operator CRDs."""

from __future__ import annotations

import tomllib

import kubernetes_validate
import pytest
import yaml

from .common import BASE, DEPLOY, K8S_VERSION, OVERLAYS, ROOT

ALL_DIRS = [str(p.relative_to(ROOT)) for p in [BASE, *OVERLAYS]]
EXAMPLE = "deploy/k8s/overlays/example"
SECRET_ENV = {"LPCAL_KAFKA__SASL_USERNAME", "LPCAL_KAFKA__SASL_PASSWORD",
              "LPCAL_HTTP__ADMIN_TOKEN"}
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30

PROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def by_kind(objs: list[dict]) -> dict[str, dict]:
    out = {}
    for obj in objs:
        assert obj["kind"] not in out, f"two {obj['kind']} objects"
        out[obj["kind"]] = obj
    return out


def pod(objs) -> tuple[dict, dict]:
    spec = by_kind(objs)["Deployment"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


@pytest.mark.parametrize("where", ALL_DIRS)
def test_every_rendered_object_validates_strictly(rendered, where):
    objs = rendered[where]
    assert {o["kind"] for o in objs} == {
        "ServiceAccount", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
        "NetworkPolicy"}
    for obj in objs:
        # strict: unknown fields are errors too; raises ValidationError with the path
        version = kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert version == K8S_VERSION.rsplit(".", 1)[0]


def test_validator_catches_a_broken_manifest(rendered):
    """The schema check is live: a typo'd field and a wrong type are rejected."""
    dep = yaml.safe_load(yaml.safe_dump(by_kind(rendered["deploy/k8s/base"])["Deployment"]))
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    dep = yaml.safe_load(yaml.safe_dump(by_kind(rendered["deploy/k8s/base"])["Deployment"]))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


@pytest.mark.parametrize("where", ALL_DIRS)
def test_security_context(rendered, where):
    spec, c = pod(rendered[where])
    psc, csc = spec["securityContext"], c["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] == 10001
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert csc["runAsNonRoot"] is True
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in csc or csc["privileged"] is False
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("where", ALL_DIRS)
def test_ports_probes_resources(rendered, where):
    _, c = pod(rendered[where])
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]) or (
            kind == "limits" and "memory" in c["resources"][kind]), kind
    assert "memory" in c["resources"]["limits"]


@pytest.mark.parametrize("where", ALL_DIRS)
def test_secrets_come_from_secret_refs(rendered, where):
    _, c = pod(rendered[where])
    env = {e["name"]: e for e in c["env"]}
    assert SECRET_ENV <= set(env)
    for name in SECRET_ENV:
        assert "value" not in env[name], f"{name} must not be inlined"
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "lpcal-secrets" and ref["key"]
        # the base config is PLAINTEXT without an admin token: the pod starts without the
        # Secret (a required secretKeyRef would hold it in CreateContainerConfigError)
        assert ref.get("optional") is True, f"{name}: secretKeyRef must be optional"
    for name in env:
        assert name.startswith("LPCAL_"), name  # settings env prefix


@pytest.mark.parametrize("where", ALL_DIRS)
def test_writable_paths_are_emptydirs_and_config_is_mounted(rendered, where):
    objs = rendered[where]
    spec, c = pod(objs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in ("/tmp", "/var/lib/lpcal"):
        assert "emptyDir" in volumes[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly", False)
    cfg = mounts["/etc/lpcal"]
    assert cfg["readOnly"] is True
    cm = by_kind(objs)["ConfigMap"]
    assert volumes[cfg["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert cm["metadata"]["name"].startswith("lpcal-config-")  # content hash -> rollout
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["LPCAL_CONFIG"] == "/etc/lpcal/lpcal.toml"
    assert "lpcal.toml" in cm["data"]
    tomllib.loads(cm["data"]["lpcal.toml"])  # the shipped config parses


@pytest.mark.parametrize("where", ALL_DIRS)
def test_objects_are_wired_together(rendered, where):
    k = by_kind(rendered[where])
    dep, svc, pdb, sa = k["Deployment"], k["Service"], k["PodDisruptionBudget"], k["ServiceAccount"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for selector in (dep["spec"]["selector"]["matchLabels"], svc["spec"]["selector"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= pod_labels.items()
        assert selector.get("app.kubernetes.io/name") == "lpcal"
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "http" and port["targetPort"] == "http"
    namespaces = {o["metadata"].get("namespace") for o in rendered[where]}
    assert len(namespaces) == 1


def test_example_overlay(rendered):
    objs = rendered[EXAMPLE]
    dep = by_kind(objs)["Deployment"]
    assert dep["spec"]["replicas"] == 2
    assert {o["metadata"]["namespace"] for o in objs} == {"lpcal-example"}
    _, c = pod(objs)
    assert c["image"] == f"ghcr.io/example/lpcal:{PROJECT_VERSION}"
    env = {e["name"]: e for e in c["env"]}
    assert env["LPCAL_KAFKA__BOOTSTRAP_SERVERS"]["value"]
    assert SECRET_ENV <= set(env)  # the patch merged env, it did not replace it
    # base has no namespace: it is set by overlays
    assert {o["metadata"].get("namespace") for o in rendered["deploy/k8s/base"]} == {None}


def _find_shutdown_grace(config: dict) -> int:
    """``shutdown_grace_seconds`` at top level or in exactly one table; default 30."""
    found = []
    if "shutdown_grace_seconds" in config:
        found.append(config["shutdown_grace_seconds"])
    for value in config.values():
        if isinstance(value, dict) and "shutdown_grace_seconds" in value:
            found.append(value["shutdown_grace_seconds"])
    assert len(found) <= 1, "shutdown_grace_seconds is set in several places"
    return int(found[0]) if found else DEFAULT_SHUTDOWN_GRACE_SECONDS


@pytest.mark.parametrize("config_file", ["config/lpcal.toml", "deploy/k8s/base/lpcal.toml"])
@pytest.mark.parametrize("where", ALL_DIRS)
def test_termination_grace_is_shutdown_grace_plus_10(rendered, where, config_file):
    path = ROOT / config_file
    assert path.exists(), f"{config_file} is missing: the deployment needs it"
    grace = _find_shutdown_grace(tomllib.loads(path.read_text()))
    spec, _ = pod(rendered[where])
    assert spec["terminationGracePeriodSeconds"] == grace + 10


# ------------------------------------------------------------------ operator CRDs (no schema)
# kubernetes-validate ships only core API schemas; ServiceMonitor and PrometheusRule are CRDs,
# so their key fields are checked here instead.


def load_one(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1
    return docs[0]


def test_servicemonitor_targets_the_service(rendered):
    sm = load_one(DEPLOY / "k8s" / "servicemonitor.yaml")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(sm["spec"]) <= {"jobLabel", "selector", "endpoints", "namespaceSelector"}
    svc = by_kind(rendered["deploy/k8s/base"])["Service"]
    # the selector picks the Service; the job label comes from a Service label = "lpcal",
    # which the alert rules select on
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "lpcal"
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}
    to_s = lambda d: int(d.rstrip("s"))
    assert to_s(ep["scrapeTimeout"]) < to_s(ep["interval"])


def test_prometheusrule_shape():
    pr = load_one(DEPLOY / "k8s" / "prometheusrule.yaml")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1" and pr["kind"] == "PrometheusRule"
    assert set(pr) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(pr["spec"]) == {"groups"}
    for group in pr["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations"}
            assert isinstance(rule["expr"], str) and rule["expr"].strip()


@pytest.mark.parametrize("where", ALL_DIRS)
def test_daemon_settings_load_from_the_rendered_pod(rendered, where, tmp_path, monkeypatch):
    """The environment and ConfigMap a pod would get are accepted by daemon.settings, and
    terminationGracePeriodSeconds = shutdown_grace_seconds + 10."""
    from daemon import settings
    objs = rendered[where]
    spec, c = pod(objs)
    cm = by_kind(objs)["ConfigMap"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/lpcal")
    assert next(v for v in spec["volumes"] if v["name"] == mount["name"])["configMap"][
        "name"] == cm["metadata"]["name"]
    config_dir = tmp_path / "etc-lpcal"
    config_dir.mkdir()
    for key, text in cm["data"].items():
        (config_dir / key).write_text(text)
    for name in [n for n in __import__("os").environ if n.upper().startswith("LPCAL_")]:
        monkeypatch.delenv(name)
    for e in c["env"]:
        if "value" in e:
            value = e["value"]
            if e["name"] == "LPCAL_CONFIG":  # the mount path, relocated to tmp
                assert value.startswith("/etc/lpcal/")
                value = str(config_dir / value.removeprefix("/etc/lpcal/"))
        else:
            value = "dummy-" + e["valueFrom"]["secretKeyRef"]["key"]
        monkeypatch.setenv(e["name"], value)
    monkeypatch.setenv("LPCAL_SECRETS_DIR", str(tmp_path / "no-secrets"))
    monkeypatch.chdir(tmp_path)
    s = settings.load_settings()
    assert s.http.port == 8080  # the containerPort / probes port
    assert s.kafka.sasl_password.get_secret_value() == "dummy-kafka-sasl-password"
    assert s.http.admin_token.get_secret_value() == "dummy-admin-token"
    assert spec["terminationGracePeriodSeconds"] == s.shutdown_grace_seconds + 10


@pytest.mark.parametrize("where", ALL_DIRS)
def test_pod_without_the_optional_secret(rendered, where, tmp_path, monkeypatch):
    """Without Secret lpcal-secrets the kubelet leaves its optional variables unset: the base
    (PLAINTEXT) starts; the example overlay (SASL_SSL) stops with an error naming the missing
    SASL settings, not with a pod stuck in CreateContainerConfigError."""
    from daemon import settings
    objs = rendered[where]
    _, c = pod(objs)
    cm = by_kind(objs)["ConfigMap"]
    (tmp_path / "lpcal.toml").write_text(cm["data"]["lpcal.toml"])
    for name in [n for n in __import__("os").environ if n.upper().startswith("LPCAL_")]:
        monkeypatch.delenv(name)
    for e in c["env"]:
        if "value" in e:
            value = str(tmp_path / "lpcal.toml") if e["name"] == "LPCAL_CONFIG" else e["value"]
            monkeypatch.setenv(e["name"], value)
        else:
            assert e["valueFrom"]["secretKeyRef"]["optional"] is True
    monkeypatch.setenv("LPCAL_SECRETS_DIR", str(tmp_path / "no-secrets"))
    monkeypatch.chdir(tmp_path)
    protocol = next((e["value"] for e in c["env"]
                     if e["name"] == "LPCAL_KAFKA__SECURITY_PROTOCOL"), "PLAINTEXT")
    if protocol.startswith("SASL_"):
        with pytest.raises(settings.SettingsError, match="sasl"):
            settings.load_settings()
    else:
        s = settings.load_settings()
        assert s.kafka.sasl_password is None and s.http.admin_token is None


@pytest.mark.parametrize("where", ALL_DIRS)
def test_replicas_spread_over_zones_and_nodes(rendered, where):
    dep = by_kind(rendered[where])["Deployment"]
    spec, _ = pod(rendered[where])
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    constraints = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert set(constraints) == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    for c in constraints.values():
        assert c["maxSkew"] == 1
        # soft: a cluster without zone labels, or with one node, still schedules the replicas
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"
        selector = c["labelSelector"]["matchLabels"]
        # it selects this Deployment's pods only (kustomize added the common labels)
        assert selector.items() <= pod_labels.items()
        assert selector == dep["spec"]["selector"]["matchLabels"]
        assert c["matchLabelKeys"] == ["pod-template-hash"]


@pytest.mark.parametrize("where", ALL_DIRS)
def test_network_policy_admits_only_the_scraper_and_http_clients(rendered, where):
    k = by_kind(rendered[where])
    netpol, svc, dep = k["NetworkPolicy"], k["Service"], k["Deployment"]
    _, c = pod(rendered[where])
    spec = netpol["spec"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec  # Kafka stays reachable
    (rule,) = spec["ingress"]
    # only the Service's port (the container's http port: /metrics and /v1 share it)
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    service_targets = {p["targetPort"] for p in svc["spec"]["ports"]}
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert service_targets == {"http"} and "http" in container_ports
    peers = rule["from"]
    assert len(peers) == 2 and all("ipBlock" not in p for p in peers)

    def selects(selector: dict, labels: dict) -> bool:
        ok = all(labels.get(key) == v for key, v in (selector.get("matchLabels") or {}).items())
        for e in selector.get("matchExpressions") or []:
            assert e["operator"] == "In", e
            ok = ok and labels.get(e["key"]) in e["values"]
        return ok

    prometheus = {"app.kubernetes.io/name": "prometheus"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    client = {"lpcal-client": "true", "app": "checkout"}
    other_ns = {"kubernetes.io/metadata.name": "shop"}

    def admitted(pod_labels: dict, ns_labels: dict) -> bool:
        return any(selects(p["namespaceSelector"], ns_labels) and
                   selects(p["podSelector"], pod_labels) for p in peers)

    assert admitted(prometheus, monitoring)          # the metrics scraper
    assert admitted(client, other_ns) and admitted(client, monitoring)  # HTTP clients
    assert not admitted(prometheus, other_ns)        # a "prometheus" pod elsewhere
    assert not admitted({"app": "checkout"}, other_ns)  # any other pod
    assert not admitted(pod_labels, other_ns)        # not even another lpcal replica
    # kustomize's common labels did not leak into the peers' selectors
    for p in peers:
        assert "matchLabels" not in p["podSelector"], p
