"""The test scheduler's plug-in (tests/fixtures/scheduling.py): longest module first, and the timeline's summary."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from tests.fixtures import scheduling


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_modules_go_longest_first_keeping_their_tests_together_and_in_order(monkeypatch):
    monkeypatch.setattr(scheduling, "_load_tables", lambda: {"slow": {"a.py": 5.0, "b.py": 200.0}})
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2")
    config = SimpleNamespace(getoption=lambda name: "slow")
    scheduling.pytest_collection_modifyitems(config, items)
    # b measured longest, c unmeasured (UNMEASURED_S = 30 s), a shortest
    assert [i.nodeid for i in items] == ["b.py::t1", "b.py::t2", "c.py::t1", "a.py::t1", "a.py::t2"]
    other = _items("a.py::t1", "b.py::t1")
    scheduling.pytest_collection_modifyitems(SimpleNamespace(getoption=lambda name: ""), other)
    assert [i.nodeid for i in other] == ["a.py::t1", "b.py::t1"]  # no table for this -m: collection order


def test_summary_of_a_known_timeline():
    rows = [
        {"node": "m1.py::a", "worker": "gw0", "start": 0.0, "end": 10.0},
        {"node": "m1.py::b", "worker": "gw0", "start": 10.0, "end": 30.0},
        {"node": "m2.py::a", "worker": "gw1", "start": 0.0, "end": 50.0},
        {"node": "m3.py::a", "worker": "gw0", "start": 31.0, "end": 40.0},
        {"node": "m3.py::a", "worker": "main", "start": 31.0, "end": 90.0},  # a controller's line: dropped
    ]
    s = scheduling.summarize(rows)
    assert s["wall_s"] == 50.0
    assert s["workers"] == {"gw0": {"busy_s": 39.0, "idle_tail_s": 10.0}, "gw1": {"busy_s": 50.0, "idle_tail_s": 0.0}}
    assert s["modules"] == {"m2.py": 50.0, "m1.py": 30.0, "m3.py": 9.0}


def test_the_cli_writes_a_table_per_marker_expression(tmp_path, monkeypatch):
    timeline = tmp_path / "t.jsonl"
    timeline.write_text(json.dumps({"node": "m.py::a", "worker": "gw0", "start": 1.0, "end": 4.5}) + "\n")
    out = tmp_path / "seconds.json"
    out.write_text(json.dumps({"not slow": {"x.py": 1.0}}))
    monkeypatch.setattr(scheduling, "SECONDS_FILE", str(out))
    assert scheduling.main([str(timeline), "--write", "slow"]) == 0
    assert json.loads(out.read_text()) == {"not slow": {"x.py": 1.0}, "slow": {"m.py": 3.5}}
    p = subprocess.run([sys.executable, "-m", "tests.fixtures.scheduling"], capture_output=True, text=True, check=False)
    assert p.returncode == 2 and "usage" in p.stderr
