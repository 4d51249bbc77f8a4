"""What a new user hit on the command line (#45 item 13): `--stop '\\n'` means a newline, a remote error is one
line without the prompt echoed before it, and a request whose penalties turn speculation off says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runtime.cli import unescape
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def runtime_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from runtime.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_unescape_reads_c_escapes_and_nothing_else():
    assert unescape(r"\n") == "\n" and unescape(r"a\tb\r") == "a\tb\r"
    assert unescape(r"\\n") == "\\n"                 # an escaped backslash, then an n
    assert unescape(r"\x41 \u00e9 é") == r"\x41 \u00e9 é"


def test_stop_newline_on_the_command_line_stops_at_the_first_newline(bundled):
    prompt = "def add(a, b):"
    eng = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=64 << 20)))
    full = eng.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3))[0]["text"]
    assert "\n" in full
    r = runtime_cli("generate", str(bundled["target"]), "--max-tokens", "40", "--stop", r"\n", prompt)
    assert r.returncode == 0, r.stderr
    assert r.stdout == prompt + full[:full.index("\n")] + "\n"
    assert "finish: stop" in r.stderr


def test_a_remote_error_is_one_line_without_the_prompt():
    r = runtime_cli("generate", "--server", "127.0.0.1:1", "a prompt that should not be printed")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: 127.0.0.1:1: UNAVAILABLE")


def test_a_penalized_request_speculates_and_says_so(bundled):
    """The bundled target's generation_config sets repetition_penalty 1.3, so every request that leaves it out
    carries a penalty: speculation verifies under it (it once skipped such requests, so at the API it never ran)."""
    eng = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=2), CacheConfig(kv_budget_bytes=64 << 20),
                                                 speculation="ngram"))
    prompt = "x = 1\ny = 2\n" * 6
    out = eng.generate([prompt], [SamplingParams(max_tokens=24, repetition_penalty=1.3)])[0]
    assert out["usage"].spec_proposed > 0
    plain = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=2), CacheConfig(kv_budget_bytes=64 << 20)))
    assert plain.generate([prompt], [SamplingParams(max_tokens=24, repetition_penalty=1.3)])[0]["token_ids"] == \
        out["token_ids"]
    r = runtime_cli("generate", str(bundled["target"]), "--speculation", "ngram", "--max-tokens", "24", prompt)
    assert r.returncode == 0, r.stderr
    assert "speculation off" not in r.stderr and " accepted]" in r.stderr     # its stats line counts the guesses


def test_a_missing_optional_dependency_is_one_error_line_with_exit_code_2(bundled):
    """--otlp-endpoint without OpenTelemetry installed (hidden from the import system here) fails as every other
    missing extra does: `error: ...` naming the pip command, exit code 2 (was: a bare message and exit code 1)."""
    hide = "import sys; sys.modules['opentelemetry.exporter.otlp.proto.grpc.trace_exporter'] = None; "
    r = subprocess.run([sys.executable, "-c", hide + "from runtime.cli import main; main()", "serve", str(bundled["target"]),
                        "--otlp-endpoint", "http://127.0.0.1:1", "--http-port", "0", "--grpc-port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: --otlp-endpoint needs OpenTelemetry: pip install '.[tracing]'"
