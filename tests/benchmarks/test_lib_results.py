"""benchmarks.lib.results: every result file says when, where, on what device and at which commit it
was measured, and a record cannot overwrite those fields."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from benchmarks.lib import results


def test_a_result_file_is_stamped(tmp_path):
    path = results.write_json(tmp_path / "new" / "r.json", {"settings": {"n": 1}, "tok_s": 2.5})
    data = json.loads(path.read_text())
    assert list(data)[:4] == ["date", "machine", "device", "commit"]
    assert data["settings"] == {"n": 1} and data["tok_s"] == 2.5
    when = datetime.fromisoformat(data["date"])
    assert when.tzinfo is not None and abs((datetime.now(timezone.utc) - when).total_seconds()) < 60
    assert set(data["machine"]) == {"hostname", "cpus", "platform"} and data["machine"]["cpus"] >= 1
    assert isinstance(data["device"], str) and data["device"]
    assert data["commit"] is None or len(data["commit"]) == 40


def test_jsonl_records_are_stamped_each(tmp_path):
    path = tmp_path / "r.jsonl"
    results.append_jsonl(path, {"run": 1})
    results.append_jsonl(path, {"run": 2})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["run"] for r in rows] == [1, 2] and all("commit" in r and "device" in r for r in rows)


def test_a_record_may_not_set_the_stamp_itself(tmp_path):
    with pytest.raises(ValueError, match="date"):
        results.write_json(tmp_path / "r.json", {"date": "yesterday"})
    assert not (tmp_path / "r.json").exists()
