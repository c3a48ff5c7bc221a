"""deploy/kubernetes as the tests see it: its documents, the schema of each kind, its pod templates,
and every container's command line expanded as the kubelet (and, under `sh -c`, the shell) would
expand it, then parsed by the parser the `afd` entry point hands it to.

Everything is offline: the schemas are vendored under schemas/ (SOURCE.md) and their references
resolve inside them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.conftest import ROOT

MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
NAMESPACE = "default"
# what the kubelet would put in for the downward API and for a Secret's value
POD_IP = "10.244.1.7"
SECRET_VALUE = "s" * 32
SECRET_ENV = "AFD_CLUSTER_SECRET"

# $$ (an escaped $) or $(NAME): the kubelet's expansion in command, args and env values. A
# reference to a variable the container lacks stays verbatim there; here it is an error (a typo).
K8S_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
SHELL_ARITH = re.compile(r"\$\(\(\s*([A-Za-z_]\w*)\s*([-+])\s*(\d+)\s*\)\)")
SHELL_VAR = re.compile(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")
SHELLS = (["/bin/sh", "-c"], ["sh", "-c"], ["/bin/bash", "-c"], ["bash", "-c"])


@dataclass(frozen=True)
class Doc:
    file: str
    body: dict

    @property
    def name(self) -> str:
        return f"{self.file}: {self.body.get('kind')}/{self.body.get('metadata', {}).get('name')}"


@dataclass(frozen=True)
class PodTemplate:
    """A pod template of a document; `lws_role` is "leader" or "worker" in a LeaderWorkerSet."""

    doc: Doc
    template: dict
    lws_role: str | None = None

    @property
    def name(self) -> str:
        return self.doc.name + (f" ({self.lws_role})" if self.lws_role else "")

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def annotations(self) -> dict:
        return self.template.get("metadata", {}).get("annotations", {})

    @property
    def labels(self) -> dict:
        return self.template.get("metadata", {}).get("labels", {})


@dataclass(frozen=True)
class Run:
    """One container of a pod template as one pod runs it (a LeaderWorkerSet's worker template
    gives one per worker index): its environment, its argv, and the afd parser's namespace."""

    pod: PodTemplate
    container: dict
    worker_index: int | None
    env: dict
    argv: list
    command: str  # serve, launch or router
    ns: argparse.Namespace

    @property
    def name(self) -> str:
        index = f" worker {self.worker_index}" if self.pod.lws_role == "worker" else ""
        return f"{self.pod.name} container {self.container['name']}{index}"

    @property
    def serves_http(self) -> bool:
        return self.command in ("serve", "router") or self.ns.role == "attention"


def load_documents() -> list[Doc]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [Doc(path.name, body) for body in yaml.safe_load_all(path.read_text()) if body is not None]
    return docs


def _strict(schema: dict) -> None:
    """Refuses fields a CRD schema does not declare, as the API server's strict field validation
    (kubectl's default) does; the vendored Kubernetes schemas are strict already."""
    if "$ref" in schema:
        return
    props = schema.get("properties")
    if props is not None and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    for sub in (props or {}).values():
        _strict(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key, []):
            _strict(sub)


@functools.cache
def schemas() -> tuple[dict, Registry]:
    """(apiVersion, kind) -> schema, and the registry their references resolve in."""
    k8s = json.loads((SCHEMAS / "kubernetes-v1.37.0-strict.json").read_text())
    lws = json.loads((SCHEMAS / "leaderworkerset-v1.json").read_text())
    _strict(lws)
    registry = Registry().with_resource(k8s["$id"], DRAFT202012.create_resource(k8s))
    by_kind = {}
    for name, schema in [*k8s["$defs"].items(), (None, lws)]:
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            api = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            by_kind[(api, gvk["kind"])] = schema if name is None else {"$ref": f"{k8s['$id']}#/$defs/{name}"}
    return by_kind, registry


def schema_errors(doc: Doc) -> list[str]:
    by_kind, registry = schemas()
    key = (doc.body.get("apiVersion"), doc.body.get("kind"))
    if key not in by_kind:
        return [f"{doc.name}: no vendored schema for apiVersion {key[0]} kind {key[1]}"]
    validator = Draft202012Validator(by_kind[key], registry=registry)
    return [f"{doc.name}: {e.json_path}: {e.message}" for e in validator.iter_errors(doc.body)]


def pod_templates(docs: list[Doc]) -> list[PodTemplate]:
    out = []
    for doc in docs:
        kind, spec = doc.body["kind"], doc.body.get("spec", {})
        if kind in ("Deployment", "StatefulSet"):
            out.append(PodTemplate(doc, spec["template"]))
        elif kind == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            out.append(PodTemplate(doc, lwt.get("leaderTemplate", lwt["workerTemplate"]), "leader"))
            out.append(PodTemplate(doc, lwt["workerTemplate"], "worker"))
    return out


def lws_env(doc: Doc, worker_index: int) -> dict:
    """What the LeaderWorkerSet controller puts first in every container's environment (group 0)."""
    name, size = doc.body["metadata"]["name"], doc.body["spec"]["leaderWorkerTemplate"].get("size", 1)
    return {
        "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker_index),
    }


def expand_k8s(text: str, env: dict) -> str:
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(1) not in env:
            raise ValueError(f"$({m.group(1)}) names no variable of the container")
        return env[m.group(1)]

    return K8S_REF.sub(one, text)


def container_env(container: dict, first: dict) -> dict:
    env = dict(first)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand_k8s(var["value"], env)
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
        elif "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = SECRET_VALUE
        else:
            raise ValueError(f"env {var['name']}: a source these tests do not know: {var}")
    return env


def shell_words(script: str, env: dict) -> list[str]:
    """The words of `sh -c SCRIPT`, which must be one `exec afd ...`: `exec` so that the kubelet's
    SIGTERM reaches afd itself, and nothing else, since these tests parse only afd."""

    def arith(m: re.Match) -> str:
        if not env.get(m.group(1), "").isdigit():
            raise ValueError(f"$(({m.group(1)} ...)): {m.group(1)} is no number of the container's environment")
        value = int(env[m.group(1)])
        return str(value + int(m.group(3)) if m.group(2) == "+" else value - int(m.group(3)))

    def var(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ValueError(f"${name} names no variable of the container")
        return env[name]

    text = SHELL_VAR.sub(var, SHELL_ARITH.sub(arith, script))
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    operators = [w for w in words if set(w) <= set("();<>|&")]
    if operators or "$" in text or words[:1] != ["exec"]:
        raise ValueError(f"the shell must run one `exec afd ...` with no other expansion: {script!r}")
    return words[1:]


def argv(container: dict, env: dict) -> list[str]:
    words = [expand_k8s(w, env) for w in container.get("command", []) + container.get("args", [])]
    if words[:2] in SHELLS:
        if len(words) != 3:
            raise ValueError(f"sh -c takes one script here: {words}")
        return shell_words(words[2], env)
    return words


def parse(words: list[str]) -> tuple[str, argparse.Namespace]:
    """Parses `afd ...` as the entry point would: `afd router` by the router's own parser (the CLI
    hands it over before its own), the rest by `build_parser()`. Raises ValueError with argparse's
    message."""
    from afd_engine.cli import build_parser
    from afd_engine.server.pd_router import add_router_args

    if words[:1] != ["afd"] or len(words) < 2:
        raise ValueError(f"not an afd command: {words}")
    if words[1] == "router":
        parser = argparse.ArgumentParser(prog="afd router")
        add_router_args(parser)
        rest = words[2:]
    else:
        parser, rest = build_parser(), words[1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(rest)
    except SystemExit:
        raise ValueError(err.getvalue().strip().splitlines()[-1]) from None
    return ("router" if words[1] == "router" else ns.command), ns


def runs(pods: list[PodTemplate]) -> tuple[list[Run], list[str]]:
    """Every container of every pod template, expanded and parsed; and the failures, one line each."""
    out, failures = [], []
    for pod in pods:
        if pod.lws_role is None:
            indexes = [None]
        elif pod.lws_role == "leader":
            indexes = [0]
        else:
            indexes = list(range(1, pod.doc.body["spec"]["leaderWorkerTemplate"].get("size", 1)))
        for container in pod.spec["containers"]:
            for index in indexes:
                where = f"{pod.name} container {container['name']}"
                try:
                    env = container_env(container, {} if index is None else lws_env(pod.doc, index))
                    words = argv(container, env)
                    command, ns = parse(words)
                except ValueError as exc:
                    failures.append(f"{where}: {exc}")
                    continue
                if not hasattr(ns, "role"):
                    ns.role = None
                out.append(Run(pod, container, index, env, words, command, ns))
    return out, failures


def port_number(container: dict, port) -> int | None:
    """A probe's or Service's port (a number, or the name of one of the container's ports)."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    return None
