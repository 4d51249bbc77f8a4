"""tools/loadgen.py checks its optional modules before running a workload, not after it."""

import subprocess
import sys
from pathlib import Path


LOADGEN = Path(__file__).resolve().parents[2] / "tools" / "loadgen.py"


def test_plot_without_matplotlib_fails_at_once(tmp_path):
    """Runs whether or not matplotlib is installed: the child process hides it (sys.modules entry None)."""
    args = ["--url", "grpc://127.0.0.1:1", "--concurrency", "1", "--requests", "2", "--timeout", "5",
            "--plot", str(tmp_path / "lg.png")]
    hide = (f"import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = [{str(LOADGEN)!r}] + {args!r}; "
            f"runpy.run_path({str(LOADGEN)!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == ("loadgen.py: error: matplotlib (for --plot) not installed: "
                                              "pip install '.[bench]'")
    assert not (tmp_path / "lg.png").exists()
