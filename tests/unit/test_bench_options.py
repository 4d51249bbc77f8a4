"""The benchmark scripts' option parsers: what a policy or a late-streams spec means."""

import runpy
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
BURST = runpy.run_path(str(TOOLS / "bench_burst.py"))
SERVE = runpy.run_path(str(TOOLS / "bench_serve.py"))


def test_a_burst_policy_may_ask_for_unpacked_steps():
    policy = BURST["policy"]
    assert policy("4096,256,2") == (4096, 256, 2.0)
    assert policy("512,64") == (512, 64, 4.0)                 # the ratio's default, as before
    assert policy("4096,256,2,unpacked") == (4096, 256, 2.0, "unpacked")
    assert policy("4096,256,unpacked") == (4096, 256, 4.0, "unpacked")
    with pytest.raises(ValueError):
        policy("4096,256,2,packed")


def test_late_streams_are_a_count_and_milliseconds():
    late = SERVE["late_streams"]
    assert late("2,1300") == (2, 1300.0)
    with pytest.raises(ValueError):
        late("2")
