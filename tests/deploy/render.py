"""A tiny offline kustomize renderer: exactly the features deploy/k8s uses, nothing more.

There is no kustomize binary (nor Debian package) in CI, so the tests render the base and the
overlays with this module. Supported kustomization fields:

* ``resources``: YAML files inside the kustomization root, or directories holding another
  kustomization (bases may live outside the root, as in kustomize).
* ``configMapGenerator``: ``name`` + ``files`` (``path`` or ``key=path``, inside the root);
  the name gets kustomize's content-hash suffix and references to it in pod templates
  (volumes, projected volumes, envFrom, env valueFrom) are rewritten.
* ``patches``: strategic-merge patches (``path`` or inline ``patch``) matched by kind and
  name, optionally by ``target`` kind/name. Associative lists merge by their merge key
  (containers/volumes/env/... by ``name``, volumeMounts by ``mountPath``, ports by
  ``containerPort``); a ``null`` value deletes a field; other lists are replaced.
* ``namespace``, ``images`` (name -> newName/newTag/digest),
  ``commonLabels`` and ``labels`` (``pairs``, ``includeSelectors``, ``includeTemplates``)
  on Deployment, Service, PodDisruptionBudget, ServiceAccount, ConfigMap, NetworkPolicy,
  with kustomize's selector field specs for them (``api/internal/konfig/builtinpluginconsts/
  commonlabels.go``): among others the Deployment's ``topologySpreadConstraints`` and a
  NetworkPolicy's ``podSelector`` and ingress/egress peers' ``podSelector.matchLabels``, all
  only where the ``matchLabels`` already exist.

Anything else raises :class:`UnsupportedFeature` rather than being silently ignored. When a
real ``kustomize`` (or ``kubectl kustomize``) is available, tests compare the two outputs.

Usage: ``python -m tests.deploy.render deploy/k8s/overlays/example`` prints multi-doc YAML.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion", "kind", "resources", "namespace", "images", "patches",
    "configMapGenerator", "commonLabels", "labels",
}
# Kinds whose label selectors/templates we know how to extend (kustomize's fieldspecs). A path
# element "[]" walks every item of a list; paths in SELECTOR_PATHS_IF_PRESENT are kustomize's
# "create: false" specs: labels are added only where the mapping already exists.
SELECTOR_PATHS: dict[str, list[tuple[str, ...]]] = {
    "Deployment": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
    "Service": [("spec", "selector")],
    "PodDisruptionBudget": [("spec", "selector", "matchLabels")],
    "ServiceAccount": [],
    "ConfigMap": [],
    "Secret": [],
    "NetworkPolicy": [],
}
_AFFINITY = ("spec", "template", "spec", "affinity")
SELECTOR_PATHS_IF_PRESENT: dict[str, list[tuple[str, ...]]] = {
    "Deployment": [
        (*_AFFINITY, kind, "preferredDuringSchedulingIgnoredDuringExecution", "[]",
         "podAffinityTerm", "labelSelector", "matchLabels")
        for kind in ("podAffinity", "podAntiAffinity")
    ] + [
        (*_AFFINITY, kind, "requiredDuringSchedulingIgnoredDuringExecution", "[]",
         "labelSelector", "matchLabels")
        for kind in ("podAffinity", "podAntiAffinity")
    ] + [("spec", "template", "spec", "topologySpreadConstraints", "[]", "labelSelector",
          "matchLabels")],
    "NetworkPolicy": [
        ("spec", "podSelector", "matchLabels"),
        ("spec", "ingress", "[]", "from", "[]", "podSelector", "matchLabels"),
        ("spec", "egress", "[]", "to", "[]", "podSelector", "matchLabels"),
    ],
}
TEMPLATE_PATHS: dict[str, list[tuple[str, ...]]] = {
    "Deployment": [("spec", "template", "metadata", "labels")],
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# strategic-merge merge keys, by list field name (pod-spec lists only)
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "imagePullSecrets": "name",
    "volumeMounts": "mountPath", "ports": "containerPort",
}
NEEDS_HASH = "__lpcal_render_needs_hash__"


class UnsupportedFeature(ValueError):
    """The kustomization uses something this renderer does not implement."""


class RenderError(ValueError):
    """The kustomization is invalid (missing file, path outside the root, unmatched patch)."""


# --------------------------------------------------------------------------- helpers


def _load_kustomization(root: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        f = root / name
        if f.is_file():
            data = yaml.safe_load(f.read_text()) or {}
            if not isinstance(data, dict):
                raise RenderError(f"{f}: kustomization must be a mapping")
            unknown = set(data) - SUPPORTED_FIELDS
            if unknown:
                raise UnsupportedFeature(f"{f}: unsupported kustomization fields {sorted(unknown)}")
            return data
    raise RenderError(f"{root}: no kustomization.yaml")


def _inside(root: Path, rel: str, what: str) -> Path:
    """Resolve ``rel`` under ``root``; kustomize's load restrictor forbids escaping it."""
    path = (root / rel).resolve()
    if path != root.resolve() and root.resolve() not in path.parents:
        raise RenderError(f"{root}: {what} {rel!r} is outside the kustomization root")
    if not path.is_file():
        raise RenderError(f"{root}: {what} {rel!r} does not exist")
    return path


def _get(obj: dict, path: tuple[str, ...], create: bool = False) -> dict | None:
    cur = obj
    for key in path:
        nxt = cur.get(key)
        if nxt is None:
            if not create:
                return None
            nxt = cur[key] = {}
        cur = nxt
    return cur


def _existing(obj: Any, path: tuple[str, ...]) -> list[dict]:
    """The mappings at ``path`` under ``obj`` that exist ("[]" walks each list item)."""
    if not path:
        return [obj] if isinstance(obj, dict) else []
    key, rest = path[0], path[1:]
    if key == "[]":
        return [hit for item in (obj if isinstance(obj, list) else [])
                for hit in _existing(item, rest)]
    if not isinstance(obj, dict) or obj.get(key) is None:
        return []
    return _existing(obj[key], rest)


def _pod_specs(res: Resource) -> list[dict]:
    if res.get("kind") == "Deployment":
        spec = _get(res, ("spec", "template", "spec"))
        return [spec] if spec else []
    return []


def _containers(res: Resource) -> list[dict]:
    out = []
    for spec in _pod_specs(res):
        for field in ("initContainers", "containers"):
            out.extend(spec.get(field) or [])
    return out


def kustomize_hash(configmap: Resource) -> str:
    """kustomize's ConfigMap name suffix (api/hasher): sha256 over the JSON of
    ``{"data", "kind", "name"}`` (Go json: sorted keys, HTML-escaped), first 10 hex digits
    with 0->g 1->h 3->k a->m e->t. kustomize looks the name up with the path string
    ``"metadata/name"`` as one key, which never matches, so ``name`` is always ``""``
    (checked against ``kubectl kustomize`` v5.5.0 in the tests)."""
    payload = {"data": configmap.get("data") or "", "kind": "ConfigMap", "name": ""}
    if configmap.get("binaryData"):
        payload["binaryData"] = configmap["binaryData"]
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


# --------------------------------------------------------------------------- strategic merge


def strategic_merge(dest: Any, patch: Any, field: str = "") -> Any:
    """Strategic-merge ``patch`` into ``dest`` (both plain YAML data); returns a new value."""
    if isinstance(patch, dict):
        if any(isinstance(k, str) and k.startswith("$") for k in patch):
            raise UnsupportedFeature(f"strategic-merge directive in {field or 'patch'}: "
                                     f"{[k for k in patch if str(k).startswith('$')]}")
        if not isinstance(dest, dict):
            return {k: v for k, v in copy.deepcopy(patch).items() if v is not None}
        out = copy.deepcopy(dest)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = strategic_merge(None, value, key)
        return out
    if isinstance(patch, list):
        key = MERGE_KEYS.get(field)
        if key is None or not isinstance(dest, list):
            return copy.deepcopy(patch)
        by_key = {item.get(key): item for item in dest if isinstance(item, dict)}
        merged, used = [], set()
        # kustomize (kyaml) order: patch elements first (merged with their dest twin), then
        # the dest elements the patch does not mention, in dest order.
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"patch list {field!r}: element without merge key {key!r}")
            twin = by_key.get(item[key])
            merged.append(strategic_merge(twin, item, field) if twin is not None
                          else strategic_merge(None, item, field))
            used.add(item[key])
        merged.extend(copy.deepcopy(d) for d in dest if d.get(key) not in used)
        return merged
    return copy.deepcopy(patch)


# --------------------------------------------------------------------------- transformers


def _apply_patches(root: Path, spec: list, resources: list[Resource]) -> None:
    for i, entry in enumerate(spec):
        if not isinstance(entry, dict) or not ({"path", "patch"} & set(entry)):
            raise RenderError(f"{root}: patches[{i}] needs path or patch")
        unknown = set(entry) - {"path", "patch", "target"}
        if unknown:
            raise UnsupportedFeature(f"{root}: patches[{i}] fields {sorted(unknown)}")
        text = (_inside(root, entry["path"], "patch").read_text() if "path" in entry
                else entry["patch"])
        docs = [d for d in yaml.safe_load_all(text) if d]
        if len(docs) != 1 or not isinstance(docs[0], dict):
            raise UnsupportedFeature(f"{root}: patches[{i}] must be one strategic-merge "
                                     "document (JSON6902 patches are not supported)")
        patch = docs[0]
        target = entry.get("target") or {}
        if set(target) - {"kind", "name"}:
            raise UnsupportedFeature(f"{root}: patches[{i}].target supports kind and name only")
        kind = target.get("kind", patch.get("kind"))
        name = target.get("name", (patch.get("metadata") or {}).get("name"))
        hits = [j for j, r in enumerate(resources)
                if r.get("kind") == kind and r["metadata"].get("name") == name]
        if not hits:
            raise RenderError(f"{root}: patches[{i}] matches no resource {kind}/{name}")
        for j in hits:
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            meta = dict(body.get("metadata") or {})
            meta.pop("name", None)
            meta.pop("namespace", None)
            body["metadata"] = meta or None
            if body["metadata"] is None:
                del body["metadata"]
            resources[j] = strategic_merge(resources[j], body)


def _apply_namespace(ns: str, resources: list[Resource]) -> None:
    for res in resources:
        if res.get("kind") in CLUSTER_SCOPED:
            continue
        res["metadata"]["namespace"] = ns


def _apply_labels(root: Path, pairs: dict, selectors: bool, templates: bool,
                  resources: list[Resource]) -> None:
    for key, value in pairs.items():
        if not isinstance(value, str):
            raise RenderError(f"{root}: label {key!r} must be a string, got {value!r}")
    for res in resources:
        kind = res.get("kind")
        if kind not in SELECTOR_PATHS:
            raise UnsupportedFeature(f"{root}: labels on kind {kind} are not implemented")
        _get(res, ("metadata", "labels"), create=True).update(pairs)
        paths = list(SELECTOR_PATHS[kind]) if selectors else []
        if templates and not selectors:
            paths = list(TEMPLATE_PATHS.get(kind, []))
        for path in paths:
            if kind == "Service" and _get(res, path) is None:
                continue  # kustomize does not create a Service selector
            _get(res, path, create=True).update(pairs)
        if selectors:
            for path in SELECTOR_PATHS_IF_PRESENT.get(kind, []):
                for selector in _existing(res, path):
                    selector.update(pairs)


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    digest = None
    if "@" in image:
        image, digest = image.split("@", 1)
    tag = None
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        image, tag = image[:colon], image[colon + 1:]
    return image, tag, digest


def _apply_images(root: Path, spec: list, resources: list[Resource]) -> None:
    for i, entry in enumerate(spec):
        unknown = set(entry) - {"name", "newName", "newTag", "digest"}
        if unknown or "name" not in entry:
            raise UnsupportedFeature(f"{root}: images[{i}] fields {sorted(entry)}")
        for res in resources:
            for container in _containers(res):
                name, tag, digest = _split_image(container.get("image", ""))
                if name != entry["name"]:
                    continue
                name = entry.get("newName", name)
                if "newTag" in entry:
                    tag, digest = str(entry["newTag"]), None
                if "digest" in entry:
                    tag, digest = None, entry["digest"]
                container["image"] = name + (f":{tag}" if tag else "") + (
                    f"@{digest}" if digest else "")


def _generate_configmaps(root: Path, spec: list) -> list[Resource]:
    out = []
    for i, entry in enumerate(spec):
        unknown = set(entry) - {"name", "files"}
        if unknown:
            raise UnsupportedFeature(f"{root}: configMapGenerator[{i}] fields {sorted(unknown)}")
        data = {}
        for item in entry.get("files") or []:
            key, _, rel = item.rpartition("=")
            path = _inside(root, rel, f"configMapGenerator[{i}] file")
            data[key or path.name] = path.read_text()
        out.append({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": entry["name"]}, "data": data, NEEDS_HASH: True,
        })
    return out


def _rename_configmap_refs(resources: list[Resource], old: str, new: str) -> None:
    for res in resources:
        for spec in _pod_specs(res):
            for vol in spec.get("volumes") or []:
                if (vol.get("configMap") or {}).get("name") == old:
                    vol["configMap"]["name"] = new
                for src in (vol.get("projected") or {}).get("sources") or []:
                    if (src.get("configMap") or {}).get("name") == old:
                        src["configMap"]["name"] = new
        for c in _containers(res):
            for ef in c.get("envFrom") or []:
                if (ef.get("configMapRef") or {}).get("name") == old:
                    ef["configMapRef"]["name"] = new
            for env in c.get("env") or []:
                ref = (env.get("valueFrom") or {}).get("configMapKeyRef") or {}
                if ref.get("name") == old:
                    ref["name"] = new


# --------------------------------------------------------------------------- entry points


def _build(root: Path) -> list[Resource]:
    kust = _load_kustomization(root)
    resources: list[Resource] = []
    for rel in kust.get("resources") or []:
        target = (root / rel).resolve()
        if target.is_dir():
            resources.extend(_build(target))
            continue
        path = _inside(root, rel, "resource")
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if not isinstance(doc, dict) or "kind" not in doc or "metadata" not in doc:
                raise RenderError(f"{path}: not a Kubernetes object")
            resources.append(doc)
    resources.extend(_generate_configmaps(root, kust.get("configMapGenerator") or []))
    _apply_patches(root, kust.get("patches") or [], resources)
    if kust.get("namespace"):
        _apply_namespace(kust["namespace"], resources)
    if kust.get("commonLabels"):
        _apply_labels(root, kust["commonLabels"], True, True, resources)
    for i, entry in enumerate(kust.get("labels") or []):
        if set(entry) - {"pairs", "includeSelectors", "includeTemplates"}:
            raise UnsupportedFeature(f"{root}: labels[{i}] fields {sorted(entry)}")
        _apply_labels(root, entry.get("pairs") or {}, bool(entry.get("includeSelectors")),
                      bool(entry.get("includeTemplates")), resources)
    _apply_images(root, kust.get("images") or [], resources)
    return resources


def render(path: str | Path) -> list[Resource]:
    """Render the kustomization in directory ``path`` into a list of Kubernetes objects."""
    resources = _build(Path(path))
    for res in resources:
        if res.pop(NEEDS_HASH, False):
            old = res["metadata"]["name"]
            new = f"{old}-{kustomize_hash(res)}"
            res["metadata"]["name"] = new
            _rename_configmap_refs(resources, old, new)
    seen = set()
    for res in resources:
        ident = (res["kind"], res["metadata"].get("namespace"), res["metadata"]["name"])
        if ident in seen:
            raise RenderError(f"{path}: duplicate resource {ident}")
        seen.add(ident)
    return resources


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.deploy.render KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(render(argv[0]), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
