"""tools/bench_attention_cycles.py still builds against plugins/cpu/attention.cpp (it drives the op's internals,
so a change to their signatures must show here, not on the next session's machine) and reports what it says."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the driver times a clock with x86-64 assembly")
def test_the_driver_builds_and_reports_each_product_mode_against_its_floor(tmp_path):
    out = tmp_path / "cycles.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "bench_attention_cycles.py"), "--shapes", "3x64",
                    "--keys", "300", "--stream-mib", "1", "--json", str(out)], check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert 0.3 < report["clock_ghz"] < 8.0
    rows = {(r["bf16_products"], r["where"]): r for r in report["results"]}
    assert sorted(rows) == [(False, "L2"), (False, "memory"), (True, "L2"), (True, "memory")]
    # 3 rows × 64 dims: 384 multiply-adds a key for its score and 384 for its value, 16 (bf16: 32) a cycle
    assert [rows[False, "L2"]["floor_cycles"], rows[True, "L2"]["floor_cycles"]] == [24, 12]
    assert {r["keys"] for r in rows.values()} == {300}
    # the same keys and queries: bf16 products round what fp32 ones multiply exactly, so the outputs' bits differ
    assert rows[False, "L2"]["bits"] != rows[True, "L2"]["bits"]
    assert all(len(r["bits"]) == 16 for r in rows.values())
