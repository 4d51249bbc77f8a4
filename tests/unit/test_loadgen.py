"""tools/loadgen.py checks its optional modules before running a workload, not after it."""

import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

LOADGEN = Path(__file__).resolve().parents[2] / "tools" / "loadgen.py"


@pytest.mark.skipif(find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_fails_at_once(tmp_path):
    result = subprocess.run([sys.executable, str(LOADGEN), "--url", "grpc://127.0.0.1:1", "--concurrency", "1",
                             "--requests", "2", "--timeout", "5", "--plot", str(tmp_path / "lg.png")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == ("loadgen.py: error: matplotlib (for --plot) not installed: "
                                              "pip install '.[bench]'")
    assert not (tmp_path / "lg.png").exists()
