"""The installed console scripts end to end: build → inspect → verify → generate, as a user runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def run(*args, check=True):
    result = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_build_inspect_verify_generate(checkpoint, tmp_path, precision):
    model, out = checkpoint("qwen2-bf16-sharded"), tmp_path / "engine"
    built = run("compile", "build", "--model", model, "--out", out, "--precision", precision)
    assert "Qwen2ForCausalLM" in built.stdout and f"{precision} weights" in built.stdout
    assert "parameters" in built.stdout and "MiB" in built.stdout
    assert f"weights {precision}" in run("compile", "inspect", out).stdout
    verified = run("compile", "verify", out, "--model", model)
    assert "PASS" in verified.stdout and "identical" in verified.stdout
    gen = run("runtime", "generate", out, "def main():", "--max-tokens", "12")
    assert gen.stdout.startswith("def main():") and len(gen.stdout) > len("def main():")
    assert "TTFT" in gen.stderr


def test_verify_fails_against_another_checkpoint(engine, checkpoint):
    result = run("compile", "verify", engine("llama"), "--model", checkpoint("llama-llama3-rope"), check=False)
    assert result.returncode == 1 and "FAIL" in result.stdout


def test_generate_rejects_too_long_request(engine):
    result = run("runtime", "generate", engine("llama"), "x " * 100, "--max-tokens", "500", check=False)
    assert result.returncode == 2 and "context" in result.stderr


def test_help():
    for tool in ("compile", "runtime"):
        assert "Usage" in run(tool, "--help").stdout
    assert "--precision" in run("compile", "build", "--help").stdout
