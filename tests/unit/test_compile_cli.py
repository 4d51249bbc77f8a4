"""`compile build` on bad input: one-line error, exit code 2, and nothing left behind."""

import json
import shutil

import pytest
from click.testing import CliRunner

from compile.cli import main


def run_build(model, out, *extra):
    return CliRunner().invoke(main, ["build", "--model", str(model), "--out", str(out), *extra])


def assert_clean_failure(result, out, needle):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


@pytest.fixture
def broken(checkpoint, tmp_path):
    def make(edit):
        dst = tmp_path / "ckpt"
        shutil.copytree(checkpoint("llama"), dst)
        edit(dst)
        return dst
    return make


def set_config(**changes):
    def edit(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return edit


def test_missing_model_dir(tmp_path):
    assert_clean_failure(run_build(tmp_path / "nope", tmp_path / "out"), tmp_path / "out", "not found")


def test_missing_tokenizer(broken, tmp_path):
    model = broken(lambda p: (p / "tokenizer.json").unlink())
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "tokenizer.json")


def test_unsupported_architecture(broken, tmp_path):
    model = broken(set_config(architectures=["GPT2LMHeadModel"]))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "unsupported architecture")


def test_unsupported_rope_scaling(broken, tmp_path):
    model = broken(set_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "rope_scaling")


def test_missing_weights(broken, tmp_path):
    model = broken(lambda p: (p / "model.safetensors").unlink())
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "safetensors")


def test_missing_tensor_leaves_nothing(broken, tmp_path):
    """A failure deep in the export (a tensor the config promises is absent) still leaves no artifact."""
    model = broken(set_config(num_hidden_layers=3))
    assert_clean_failure(run_build(model, tmp_path / "out"), tmp_path / "out", "model.layers.2")


def test_existing_output_needs_overwrite(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_build(checkpoint("llama"), out).exit_code == 0
    result = run_build(checkpoint("llama"), out)
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert run_build(checkpoint("llama"), out, "--overwrite").exit_code == 0


def test_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("build", "inspect", "verify"):
        assert cmd in result.output


def test_int8_kv_cache_is_a_cpu_format(checkpoint, tmp_path):
    out = tmp_path / "out"
    result = run_build(checkpoint("llama"), out, "--target", "cuda", "--precision", "fp16", "--kv-cache", "int8")
    assert_clean_failure(result, out, "CPU format")
    assert run_build(checkpoint("llama"), out, "--kv-cache", "int8", "--no-report").exit_code == 0
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output
    assert "KV cache int8" in shown and "BNSH int8" in shown
    verified = CliRunner().invoke(main, ["verify", str(out), "--model", str(checkpoint("llama"))])
    assert verified.exit_code == 0 and "PASS" in verified.output
