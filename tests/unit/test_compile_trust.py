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


# A checkpoint's files are read as they claim, or refused in one line before any work.

def copy_checkpoint(checkpoint, tmp_path, name="ckpt"):
    out = tmp_path / name
    shutil.copytree(checkpoint("llama"), out)
    return out


def test_a_stale_safetensors_file_beside_the_weights_is_refused(checkpoint, tmp_path):
    """It was read too, and its tensors won: an engine built from the wrong weights, silently."""
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    make_checkpoint.write_checkpoint("tiny-llama", tmp_path / "other", seed=99)
    shutil.copy(tmp_path / "other" / "model.safetensors", ckpt / "model_old.safetensors")
    one_error_line(run_build(ckpt, tmp_path / "engine"), "model.safetensors", "model_old.safetensors", "in both")
    assert not (tmp_path / "engine").exists()


def test_each_tensor_comes_from_the_shard_the_index_names(checkpoint, tmp_path):
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    from compile.hf_source import SafetensorsFile

    names = SafetensorsFile(ckpt / "model.safetensors").names()
    # a second shard holding a stale copy of every tensor, the index naming it for one of them
    index = {"weight_map": {n: "model.safetensors" for n in names}}
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002.safetensors"
    make_checkpoint.write_checkpoint("tiny-llama", tmp_path / "other", seed=99)
    shutil.copy(tmp_path / "other" / "model.safetensors", ckpt / "model-00002.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    one_error_line(run_build(ckpt, tmp_path / "engine"), "model.safetensors", "model-00002.safetensors", "in both")
    # a shard the index names that lacks the tensor
    (ckpt / "model-00002.safetensors").unlink()
    index["weight_map"] = {n: "model.safetensors" for n in names}
    index["weight_map"]["extra.weight"] = "model.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    one_error_line(run_build(ckpt, tmp_path / "engine"), "extra.weight", "does not hold it")


@pytest.mark.parametrize("edit, needle", [
    ({"rope_theta": -1.0}, "rope_theta"), ({"rope_theta": 0}, "rope_theta"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"), ({"rms_norm_eps": [1]}, "rms_norm_eps"),
    ({"max_position_embeddings": -5}, "max_position_embeddings"), ({"hidden_size": [64]}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"), ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"architectures": {"a": 1}}, "architecture"), ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"eos_token_id": {}}, "eos_token_id"), ({"vocab_size": True}, "vocab_size"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "high_freq_factor above"),
])
def test_a_config_value_out_of_range_is_one_line(checkpoint, tmp_path, edit, needle):
    """Each of these built a broken engine (NaN rotary tables, a graph ORT refuses, a max_seq_len of -5) or ended
    in a traceback."""
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **edit}))
    one_error_line(run_build(ckpt, tmp_path / "engine"), "config.json", needle)


@pytest.mark.parametrize("name, text, needle", [
    ("config.json", "[1, 2]", "JSON object"),
    ("generation_config.json", '{"eos_token_id": {}}', "eos_token_id"),
    ("generation_config.json", "[1]", "JSON object"),
    ("generation_config.json", "{", "not valid JSON"),
    ("tokenizer_config.json", "[1]", "JSON object"),
    ("tokenizer.json", '{"not": "a tokenizer"}', "tokenizers library"),
])
def test_a_malformed_json_file_is_named_before_the_build(checkpoint, tmp_path, name, text, needle):
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    (ckpt / name).write_text(text)
    one_error_line(run_build(ckpt, tmp_path / "engine"), name, needle)


def test_a_huge_safetensors_header_length_is_refused_before_it_is_read(checkpoint, tmp_path):
    """A corrupt length within the file's size was read whole: 2.1 GB resident for a sparse 1 GiB file."""
    ckpt = copy_checkpoint(checkpoint, tmp_path)
    size = 1 << 30
    with open(ckpt / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", size - 8))
        f.truncate(size)                         # sparse: a few KB on disk
    one_error_line(run_build(ckpt, tmp_path / "engine"), "header length", "limit")


def test_fingerprints_keep_file_names_and_contents_apart(tmp_path):
    from compile.hf_source import fingerprint

    x, y = tmp_path / "x", tmp_path / "y"
    x.mkdir(), y.mkdir()
    (x / "a.json").write_text("A"), (x / "b.json").write_text("B")
    (y / "a.json").write_text("Ab.jsonB")
    assert fingerprint(x) != fingerprint(y)


def test_an_engine_folder_is_made_as_mkdir_makes_folders(checkpoint, tmp_path):
    """mkdtemp's 0700 survived the swap: a server under another account lost an engine it could read before."""
    import os

    old = os.umask(0o022)
    try:
        assert run_build(checkpoint("llama"), tmp_path / "engine").exit_code == 0
    finally:
        os.umask(old)
    assert (tmp_path / "engine").stat().st_mode & 0o777 == 0o755


def test_a_build_killed_between_its_renames_loses_no_engine(engine, checkpoint, tmp_path):
    """The old engine renamed aside, the new one not yet in place: the next writer puts the old one back first."""
    out = tmp_path / "engine"
    shutil.copytree(engine("llama"), out)
    before = tree(out)
    out.rename(tmp_path / ".engine.partial-abc123.old")                # as the kill left it
    one_error_line(run_build(checkpoint("llama"), out), "already exists", "--overwrite")
    assert tree(out) == before and not list(tmp_path.glob(".engine.partial-*"))
    assert run_build(checkpoint("llama"), out, "--overwrite").exit_code == 0
