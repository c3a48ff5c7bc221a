"""bench_messages: every control message kind timed both ways, and the figures written on request."""

from __future__ import annotations

import json

from tests.process_helpers import bench_run


def test_a_short_run_times_every_message(tmp_path):
    out = tmp_path / "messages.json"
    res = bench_run("bench_messages.py", "--number", "20", "--repeat", "2", "--json", str(out))
    record = json.loads(out.read_text())
    assert record["number"] == 20 and len(record["rows"]) == 4
    for row in record["rows"]:
        assert row["bytes"] > 0 and row["encode_us"] > 0 and row["decode_us"] > 0, row
        assert row["message"] in res.stdout
