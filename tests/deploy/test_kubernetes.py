"""The Kubernetes manifests of deploy/kubernetes, checked offline: every document against its
kind's schema (vendored), every container's command line by afd's own parser, and what a
deployment of the engine needs from Kubernetes (docs/deployments.md, "Kubernetes"): probes on
/health, a grace period longer than the drain, scrape annotations, resources, the cluster secret
from a Secret, roles of a LeaderWorkerSet that agree, and a router that names every instance."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import pytest

from tests.deploy import manifests as m

FILES = {"single.yaml", "afd.yaml", "pd-afd.yaml"}
TOPOLOGY = (
    "mode",
    "dp_size",
    "ffn_nodes",
    "ffn_ranks_per_node",
    "micro_batches",
    "dispatch",
    "transport",
    "model_path",
    "dist_init_addr",
    "disaggregation_mode",
)


@pytest.fixture(scope="module")
def docs():
    return m.load_documents()


@pytest.fixture(scope="module")
def parsed(docs):
    return m.runs(m.pod_templates(docs))


@pytest.fixture(scope="module")
def runs(parsed):
    return parsed[0]


def serving(runs):
    return [r for r in runs if r.serves_http]


def test_the_manifests_are_there(docs):
    assert {d.file for d in docs} == FILES
    assert {d.body["kind"] for d in docs} == {"Deployment", "Service", "StatefulSet", "LeaderWorkerSet"}


def test_every_document_matches_its_kinds_schema(docs):
    errors = [e for d in docs for e in m.schema_errors(d)]
    assert not errors, "\n".join(errors)


def test_a_document_of_an_unknown_kind_or_field_fails():
    assert m.schema_errors(m.Doc("x.yaml", {"apiVersion": "v1", "kind": "ConfigMap"})) == [
        "x.yaml: ConfigMap/None: no vendored schema for apiVersion v1 kind ConfigMap"
    ]
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": "a"}}
    lws["spec"] = {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": []}}, "sise": 2}}
    (error,) = m.schema_errors(m.Doc("x.yaml", lws))
    assert error.startswith("x.yaml: LeaderWorkerSet/a: $.spec.leaderWorkerTemplate: Additional properties")
    assert "'sise' was unexpected" in error


def test_every_container_runs_an_afd_command_its_parser_accepts(parsed):
    runs, failures = parsed
    assert not failures, "\n".join(failures)
    assert {r.command for r in runs} == {"serve", "launch", "router"}
    assert {r.pod.doc.file for r in serving(runs)} == FILES


def test_a_command_line_is_expanded_and_parsed_as_in_a_pod():
    env = m.container_env(
        {"env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]},
        {"LWS_WORKER_INDEX": "2", "LWS_LEADER_ADDRESS": "a-0.a.default"},
    )
    script = (
        'exec afd launch --role ffn --node-rank "$((LWS_WORKER_INDEX - 1))" --dist-init-addr $(LWS_LEADER_ADDRESS):1'
    )
    words = m.argv({"command": ["/bin/sh", "-c"], "args": [script + ' --host-ip "${POD_IP}"']}, env)
    assert words[4:] == ["--node-rank", "1", "--dist-init-addr", "a-0.a.default:1", "--host-ip", m.POD_IP]
    assert m.parse(words)[1].node_rank == 1
    with pytest.raises(ValueError, match=r"\$\(LWS_GROUP_SIZE\) names no variable"):
        m.argv({"command": ["afd", "launch", "--nnodes=$(LWS_GROUP_SIZE)"]}, env)
    with pytest.raises(ValueError, match="one `exec afd ...`"):
        m.argv({"command": ["sh", "-c", "afd serve; sleep 1"]}, env)
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        m.parse(["afd", "serve", "--no-such-flag"])
    with pytest.raises(ValueError, match="unrecognized arguments: --mode"):
        m.parse(["afd", "router", "--mode", "afd"])


def test_serving_containers_listen_beyond_loopback_and_probe_health(runs):
    problems = []
    for r in serving(runs):
        c = r.container
        if r.ns.host not in ("0.0.0.0", "::"):
            problems.append(f"{r.name}: --host {r.ns.host} is out of the kubelet's and the Service's reach")
        if r.ns.port not in [p["containerPort"] for p in c.get("ports", [])]:
            problems.append(f"{r.name}: no container port is --port {r.ns.port}")
        scheme = "HTTPS" if r.ns.ssl_certfile else "HTTP"
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(kind)
            if probe is None:
                if kind != "startupProbe":
                    problems.append(f"{r.name}: no {kind}")
                continue
            get = probe.get("httpGet", {})
            got = (get.get("path"), m.port_number(c, get.get("port")), get.get("scheme", "HTTP"))
            if got != ("/health", r.ns.port, scheme):
                problems.append(f"{r.name}: {kind} is not GET {scheme} /health on --port {r.ns.port}: {probe}")
        live = c.get("livenessProbe", {})
        patience = live.get("failureThreshold", 3) * live.get("periodSeconds", 10)
        if patience <= r.ns.drain_timeout:
            # /health answers 503 for the whole drain: liveness must not kill the pod meanwhile
            problems.append(
                f"{r.name}: liveness gives up after {patience} s, within --drain-timeout {r.ns.drain_timeout}"
            )
    assert not problems, "\n".join(problems)


def test_the_grace_period_outlasts_the_drain(runs):
    problems = []
    leaders = {}
    for r in serving(runs):
        grace = r.pod.spec.get("terminationGracePeriodSeconds", 30)
        pre_stop = r.container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        if grace <= pre_stop + r.ns.drain_timeout:
            problems.append(
                f"{r.name}: terminationGracePeriodSeconds {grace} <= preStop {pre_stop} s + --drain-timeout "
                f"{r.ns.drain_timeout}: the SIGKILL would cut the drain short"
            )
        leaders[r.pod.doc.name] = grace
    for r in runs:
        # FFN pods serve the leader's drain: they must not be killed before it ends
        grace = r.pod.spec.get("terminationGracePeriodSeconds", 30)
        if r.pod.lws_role == "worker" and grace < leaders.get(r.pod.doc.name, 0):
            problems.append(f"{r.name}: grace {grace} s is shorter than its leader's {leaders[r.pod.doc.name]} s")
    assert not problems, "\n".join(problems)


def test_prometheus_scrapes_every_serving_pod_and_no_other(runs):
    problems = []
    for r in runs:
        got = {k: v for k, v in r.pod.annotations.items() if k.startswith("prometheus.io/")}
        want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(r.ns.port), "prometheus.io/path": "/metrics"}
        if r.serves_http and got != want:
            problems.append(f"{r.name}: annotations {got}, not {want}")
        if not r.serves_http and got:
            problems.append(f"{r.name}: serves no /metrics but carries {got}")
    assert not problems, "\n".join(problems)


def ranks_on_pod(r: m.Run) -> int:
    ns = r.ns
    if r.command == "launch":
        return ns.dp_size if ns.role == "attention" else ns.ffn_ranks_per_node
    return ns.dp_size + (ns.ffn_nodes * ns.ffn_ranks_per_node if ns.mode == "afd" else 0)


def test_every_container_has_resources_and_engines_a_gpu_per_rank(runs):
    problems = []
    for r in runs:
        res = r.container.get("resources", {})
        requests, limits = res.get("requests", {}), res.get("limits", {})
        if not {"cpu", "memory"} <= requests.keys() or "memory" not in limits:
            problems.append(f"{r.name}: needs cpu and memory requests and a memory limit: {res}")
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if r.command == "router":
            if gpus:
                problems.append(f"{r.name}: the router needs no GPU")
            continue
        needed = r.ns.base_gpu_id + (ranks_on_pod(r) - 1) * r.ns.gpu_id_step + 1
        if gpus < needed:
            problems.append(f"{r.name}: {ranks_on_pod(r)} ranks take GPUs 0..{needed - 1}, the pod gets {gpus}")
    assert not problems, "\n".join(problems)


def loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def test_the_cluster_secret_comes_from_a_secret(runs):
    problems, refs = [], {}
    for r in runs:
        for var in r.container.get("env", []):
            if var["name"] == m.SECRET_ENV:
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if "value" in var or not ref or not ref.get("name") or not ref.get("key"):
                    problems.append(f"{r.name}: {m.SECRET_ENV} must come from a secretKeyRef: {var}")
                else:
                    refs.setdefault(r.pod.doc.file, set()).add((ref["name"], ref["key"]))
        if r.command == "router":
            continue
        if r.ns.cluster_secret is not None or r.ns.insecure_cluster:
            problems.append(f"{r.name}: --cluster-secret shows in `ps`, --insecure-cluster drops the secret")
        across_pd = r.ns.disaggregation_mode != "null" and not loopback(f"{r.ns.disaggregation_host}:0")
        across = r.command == "launch" and not loopback(r.ns.dist_init_addr)
        if (across or across_pd) and m.SECRET_ENV not in r.env:
            problems.append(f"{r.name}: talks to other pods without {m.SECRET_ENV}")
    problems += [f"{f}: every role needs the same secret, not {sorted(s)}" for f, s in refs.items() if len(s) > 1]
    assert refs.keys() == {"afd.yaml", "pd-afd.yaml"}
    assert not problems, "\n".join(problems)


def test_the_roles_of_a_leader_worker_set_make_one_deployment(runs):
    problems = []
    for name in {r.pod.doc.name for r in runs if r.pod.lws_role}:
        group = [r for r in runs if r.pod.doc.name == name]
        body = group[0].pod.doc.body
        size, lws = body["spec"]["leaderWorkerTemplate"]["size"], body["metadata"]["name"]
        leader = [r for r in group if r.pod.lws_role == "leader"]
        workers = [r for r in group if r.pod.lws_role == "worker"]
        if [r.ns.role for r in leader] != ["attention"] or {r.ns.role for r in workers} != {"ffn"}:
            problems.append(f"{name}: the leader must be the attention role, the workers FFN nodes")
            continue
        for r in group:
            differ = [k for k in TOPOLOGY if getattr(r.ns, k) != getattr(leader[0].ns, k)]
            if differ:
                problems.append(f"{r.name}: differs from its leader in {differ}")
            if r.ns.nnodes != size or size != 1 + r.ns.ffn_nodes:
                problems.append(f"{r.name}: --nnodes {r.ns.nnodes}, size {size}, --ffn-nodes {r.ns.ffn_nodes}")
            if r.ns.dist_init_addr.rsplit(":", 1)[0] != f"{lws}-0.{lws}.{m.NAMESPACE}":
                problems.append(f"{r.name}: the rendezvous {r.ns.dist_init_addr} is not the group's leader")
        if sorted(r.ns.node_rank for r in workers) != list(range(leader[0].ns.ffn_nodes)):
            problems.append(f"{name}: FFN node ranks {[r.ns.node_rank for r in workers]}")
    assert not problems, "\n".join(problems)


def test_services_select_serving_pods_on_their_ports(docs, runs):
    problems = []
    for svc in (d for d in docs if d.body["kind"] == "Service"):
        selector = svc.body["spec"]["selector"]
        chosen = [r for r in runs if r.pod.doc.file == svc.file and selector.items() <= r.pod.labels.items()]
        if not chosen or not all(r.serves_http for r in chosen):
            problems.append(f"{svc.name}: selects {[r.name for r in chosen]}, not serving pods only")
        for port in svc.body["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            problems += [
                f"{svc.name}: no port {target} in {r.name}" for r in chosen if not m.port_number(r.container, target)
            ]
    assert not problems, "\n".join(problems)


def instance_addresses(docs, runs) -> dict:
    """(host, port) -> disaggregation mode of every instance with a stable name: the pods of a
    StatefulSet (through its headless Service) and the leaders of a LeaderWorkerSet."""
    headless = {
        d.body["metadata"]["name"]
        for d in docs
        if d.body["kind"] == "Service" and d.body["spec"].get("clusterIP") == "None"
    }
    out = {}
    for r in serving(runs):
        body = r.pod.doc.body
        name, replicas = body["metadata"]["name"], body["spec"].get("replicas", 1)
        if body["kind"] == "StatefulSet" and body["spec"]["serviceName"] in headless:
            sub = body["spec"]["serviceName"]
        elif r.pod.lws_role == "leader":
            sub = name
        else:
            continue
        out.update({(f"{name}-{i}.{sub}", r.ns.port): r.ns.disaggregation_mode for i in range(replicas)})
    return out


def test_the_router_names_every_instance(docs, runs):
    (router,) = [r for r in runs if r.command == "router"]
    known = instance_addresses(docs, runs)
    for mode, urls in (("prefill", router.ns.prefill), ("decode", router.ns.decode)):
        named = {(urlsplit(u).hostname, urlsplit(u).port) for u in urls}
        assert named == {a for a, role in known.items() if role == mode}, mode
        assert len(named) == len(urls) >= 2, f"two or more {mode} instances, once each, for failover"
