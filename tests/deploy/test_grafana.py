"""deploy/grafana/afd-dashboard.json: a dashboard Grafana can import, whose every query asks for a
metric the engine really exposes. The names come from a real `afd serve` on the tiny model (its
/metrics after one request) and from `afd router`'s app in process; the router's labelled families
that only appear once an instance fails (failovers) are taken from its registry's definitions."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Server

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "afd-dashboard.json"
# what a scrape of each metric type yields, for families defined but not exposed yet
SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
# PromQL words that are neither metrics nor functions
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
LABEL_VALUES = re.compile(r"^label_values\((\w+),\s*\w+\)$")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels, keywords or
    Grafana variables)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana's variables ($instance, $__rate_interval)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"(?<![\w:])\d[\w.]*", " ", s)  # numbers and durations (0.99, 5m, 1e3)
    names = set()
    for m in IDENTIFIER.finditer(s):
        if m.group() not in KEYWORDS and not s[m.end() :].lstrip().startswith("("):  # "(": a function
            names.add(m.group())
    return names


def _panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def _queries(dashboard: dict) -> dict[str, set[str]]:
    """Where (panel title / variable name) -> the metric names its queries select."""
    found = {}
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            found[f"panel {panel['title']!r} {target['refId']}"] = metric_names(target["expr"])
    for var in dashboard["templating"]["list"]:
        match = LABEL_VALUES.match(var["definition"])
        assert match, f"variable {var['name']}: expected label_values(METRIC, LABEL), got {var['definition']!r}"
        found[f"variable {var['name']!r}"] = {match.group(1)}
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def _router_names() -> set[str]:
    """`afd router`'s /metrics, in process, and the names its registry's families will have."""
    from afd_engine.server.pd_router import PDRouter, build_router_app

    router = PDRouter(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    app = build_router_app(router)

    async def get() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return (await client.get("/metrics")).text

    names = _sample_names(asyncio.run(get()))
    for family in router.registry.collect():  # (labelled families without a child yet)
        names |= {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
    return names


@pytest.fixture(scope="module")
def exposed(tiny_v3) -> set[str]:
    """The sample names a server (after one request) and a router expose."""
    server = Server(tiny_v3)
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        names = _sample_names(httpx.get(server.url + "/metrics").text)
    finally:
        server.stop()
    return names | _router_names()


def test_metric_names_reads_promql():
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(afd_x_bucket{instance=~"$instance", a="b{c}"}[$__rate_interval])))'
        " / on (instance) group_left (rank) sum without (job) (afd_y offset 5m) > bool 0 unless afd_z"
    )
    assert metric_names(expr) == {"afd_x_bucket", "afd_y", "afd_z"}


def test_the_dashboard_has_the_shape_grafana_imports(dashboard):
    assert dashboard["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": dashboard["__inputs"][0]["description"],
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    assert dashboard["title"] and dashboard["uid"] and dashboard["id"] is None
    assert isinstance(dashboard["schemaVersion"], int)
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        pos = panel["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and pos["h"] > 0 and 0 < pos["w"] and pos["x"] + pos["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"panel {panel['title']!r}: refIds must be unique"
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] == "${DS_PROMETHEUS}"


def test_the_panels_do_not_overlap(dashboard):
    taken: dict[tuple[int, int], str] = {}
    for panel in _panels(dashboard):
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = panel["title"]


def test_every_query_selects_metrics_the_engine_exposes(dashboard, exposed):
    queries = _queries(dashboard)
    assert all(queries.values()), [where for where, names in queries.items() if not names]
    missing = {where: sorted(names - exposed) for where, names in queries.items() if names - exposed}
    assert not missing, f"metrics the engine does not expose: {missing}"
