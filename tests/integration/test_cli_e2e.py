"""The installed console scripts end to end: build → inspect → verify → generate, as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_harness import ServerThread
from test_server import self_signed

BIN = Path(sys.executable).parent


def run(*args, check=True, **kwargs):
    result = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=300,
                            **kwargs)
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


def test_verify_refuses_another_checkpoint(engine, checkpoint):
    """The checkpoint's fingerprint is not the one the engine recorded: one error line, exit 2 (#45 item 11; was a
    comparison that failed, or a traceback when the shapes differed)."""
    result = run("compile", "verify", engine("llama"), "--model", checkpoint("llama-llama3-rope"), check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "is not the checkpoint the engine was built from" in result.stderr


def test_generate_rejects_too_long_request(engine):
    result = run("runtime", "generate", engine("llama"), "x " * 100, "--max-tokens", "500", check=False)
    assert result.returncode == 2 and "context" in result.stderr


def test_help():
    for tool in ("compile", "runtime"):
        assert "Usage" in run(tool, "--help").stdout
    assert "--precision" in run("compile", "build", "--help").stdout


def test_generate_says_the_prompt_is_missing(engine, tmp_path):
    """`runtime generate ENGINE` without a prompt is a mistake to name, not a completion of the folder's path."""
    env = {**os.environ, "QUICKSILVER_ENGINE": str(engine("llama"))}
    result = run("runtime", "generate", engine("llama"), "--max-tokens", "2", check=False, env=env, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"error: the prompt is missing ({engine('llama')} is a folder, not a prompt): "
                             "runtime generate [ENGINE] PROMPT\n")


@pytest.mark.parametrize("local,named", [(["ENGINE"], "ENGINE"), (["--draft", "ENGINE"], "--draft"),
                                         (["--threads", "2"], "--threads"), (["--speculation", "off"], "--speculation")])
def test_generate_server_refuses_local_options(engine, local, named):
    args = [engine("llama") if a == "ENGINE" else a for a in local]
    result = run("runtime", "generate", "--server", "127.0.0.1:1", *args, "def f():", check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"error: --server streams from the server's engine; {named} apply to a local engine only\n"


def test_generate_server_over_tls(engine, tmp_path):
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path)
    server = ServerThread(engine("llama"), tls_cert=cert, tls_key=key)
    try:
        gen = run("runtime", "generate", "--server", server.grpc_target, "--tls-ca", cert, "def f():",
                  "--max-tokens", "3", "--temperature", "0")
        assert gen.stdout.startswith("def f():") and "3 generated, finish: length" in gen.stderr
    finally:
        server.stop()


def test_help_shows_defaults_and_one_engine_name():
    serve, generate = run("runtime", "serve", "--help").stdout, run("runtime", "generate", "--help").stdout
    assert "[default: (the context length); x>=1]" in " ".join(serve.split())
    for text in (serve, generate):
        assert "[default: (min(2, cores)); x>=1]" in " ".join(text.split()) and "ENGINE_DIR" not in text
    assert "Usage: runtime generate [OPTIONS] [ENGINE] PROMPT" in generate


def test_a_terminated_build_leaves_no_staging_or_baseline_behind(checkpoint, tmp_path):
    """SIGTERM (a CI timeout, `docker stop`) ends `compile build` as Ctrl-C does: its staging folder and the
    accuracy report's fp32 baseline are removed (killed, both stayed: tens of MB to GBs, never cleaned up)."""
    import signal
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "engine"
    proc = subprocess.Popen([str(BIN / "compile"), "build", "--model", str(checkpoint("qwen2")), "--out", str(out),
                             "--precision", "int8"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "tmp").glob("qs-baseline-*")) and proc.poll() is None:   # in its report
            assert time.monotonic() < deadline, "the build never reached its accuracy report"
            time.sleep(0.01)
        assert list(tmp_path.glob(".engine.partial-*")), "the build is staging"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert not out.exists() and not list(tmp_path.glob(".engine.partial-*"))
    assert not list((tmp_path / "tmp").glob("qs-baseline-*"))
