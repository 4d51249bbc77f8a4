"""Issue #45 items 3, 11 and 13 (part): `--overwrite` replaces only our engines, `compile verify` checks the
checkpoint it compares against, and make_checkpoint records the dtype it wrote."""

import json
import shutil
import struct

import pytest
from click.testing import CliRunner

from compile.cli import main

from compile import synthetic as make_checkpoint


def run_build(model, out, *extra):
    return CliRunner().invoke(main, ["build", "--model", str(model), "--out", str(out), "--no-report", *extra])


def one_error_line(result, *needles):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    errors = [l for l in lines if l.startswith("error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), result.output
    assert "Traceback" not in result.output and len(lines) == 1, result.output
    return errors[0]


def tree(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


# Item 3: a folder is an engine only if its manifest is ours and it holds nothing the manifest does not list.

def test_overwrite_keeps_a_folder_whose_manifest_is_not_ours(checkpoint, tmp_path):
    """The repro: a web app's manifest.json made `--overwrite` delete the whole folder, src/ included."""
    webapp = tmp_path / "webapp"
    (webapp / "src").mkdir(parents=True)
    (webapp / "manifest.json").write_text('{"name":"my app"}')
    (webapp / "src" / "index.js").write_text("precious")
    before = tree(webapp)
    one_error_line(run_build(checkpoint("llama"), webapp, "--precision", "int8", "--overwrite"),
                   "not a Quicksilver engine")
    assert tree(webapp) == before and (webapp / "src" / "index.js").read_text() == "precious"


def test_overwrite_keeps_an_engine_of_another_format_version(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_build(checkpoint("llama"), out).exit_code == 0
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    one_error_line(run_build(checkpoint("llama"), out, "--overwrite"), "format version 99")
    assert json.loads((out / "manifest.json").read_text())["format_version"] == 99


def test_overwrite_keeps_a_user_file_inside_an_engine(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_build(checkpoint("llama"), out).exit_code == 0
    (out / "notes").mkdir()
    (out / "notes" / "todo.txt").write_text("mine")
    (out / "eval.txt").write_text("mine too")
    before = tree(out)
    one_error_line(run_build(checkpoint("llama"), out, "--overwrite"), "eval.txt", "notes/")
    assert tree(out) == before and (out / "notes" / "todo.txt").read_text() == "mine"


def test_overwrite_names_a_few_unknown_files_then_a_count(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_build(checkpoint("llama"), out).exit_code == 0
    for i in range(7):
        (out / f"user{i}.txt").write_text("x")
    line = one_error_line(run_build(checkpoint("llama"), out, "--overwrite"), "user0.txt", "and 4 more")
    assert "user6.txt" not in line and len(line) < 400
    assert len(list(out.glob("user*.txt"))) == 7


def test_overwrite_still_replaces_a_clean_engine(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_build(checkpoint("llama"), out).exit_code == 0
    assert run_build(checkpoint("llama"), out, "--overwrite", "--precision", "fp16").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["precision"]["weights"] == "fp16"


# Item 11: `compile verify` defaults --model to the recorded source and refuses another checkpoint in one line.

def test_verify_defaults_to_the_recorded_source(engine):
    result = CliRunner().invoke(main, ["verify", str(engine("llama"))])
    assert result.exit_code == 0 and result.output.endswith(": PASS\n"), result.output


def test_verify_refuses_another_checkpoint(engine, checkpoint):
    """--model of another checkpoint was a 26-line traceback."""
    other = checkpoint("mistral")
    line = one_error_line(CliRunner().invoke(main, ["verify", str(engine("llama")), "--model", str(other)]),
                          str(other), str(checkpoint("llama")))
    assert "fingerprint" in line


def test_verify_a_copy_of_the_source_passes(engine, checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint("llama"), copy)
    result = CliRunner().invoke(main, ["verify", str(engine("llama")), "--model", str(copy)])
    assert result.exit_code == 0, result.output


def test_verify_without_the_source_says_what_to_pass(engine, tmp_path):
    eng = tmp_path / "engine"
    shutil.copytree(engine("llama"), eng)
    m = json.loads((eng / "manifest.json").read_text())
    m["source"]["path"] = str(tmp_path / "gone")
    (eng / "manifest.json").write_text(json.dumps(m))
    one_error_line(CliRunner().invoke(main, ["verify", str(eng)]), str(tmp_path / "gone"), "--model")


def test_verify_a_broken_checkpoint_is_one_line(engine, checkpoint, tmp_path):
    """A checkpoint whose config.json contradicts its tensors (its fingerprint recorded, so only the reference
    finds out) fails in one line; it was a numpy ValueError traceback."""
    eng, ckpt = tmp_path / "engine", tmp_path / "ckpt"
    shutil.copytree(engine("llama"), eng)
    shutil.copytree(checkpoint("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    m = json.loads((eng / "manifest.json").read_text())
    from compile.hf_source import fingerprint
    m["source"].update(path=str(ckpt), fingerprint=fingerprint(ckpt))
    (eng / "manifest.json").write_text(json.dumps(m))
    one_error_line(CliRunner().invoke(main, ["verify", str(eng), "--model", str(ckpt)]))


# Item 13 (part): the checkpoint's config.json names the dtype its tensors are stored in.

@pytest.mark.parametrize("dtype, name, stored", [("bf16", "bfloat16", "BF16"), ("fp16", "float16", "F16"),
                                                 ("fp32", "float32", "F32")])
def test_make_checkpoint_records_the_dtype(tmp_path, dtype, name, stored):
    out = make_checkpoint.write_checkpoint("tiny-llama", tmp_path / dtype, dtype=dtype)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == name
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {stored}
