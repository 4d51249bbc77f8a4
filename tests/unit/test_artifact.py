"""Artifact integrity: a damaged or foreign engine gives one clear error line and exit code 2."""

import json
import shutil

import pytest
from click.testing import CliRunner

from artifact import load
from compile.cli import main as compile_main
from artifact.errors import ArtifactError
from runtime.cli import main as runtime_main
from runtime.backends.cpu.runner import ModelRunner


@pytest.fixture
def damaged(engine, tmp_path):
    def copy():
        dst = tmp_path / "engine"
        shutil.copytree(engine("llama"), dst)
        return dst
    return copy


def edit_manifest(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    for key, value in changes.items():
        target = m
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    (path / "manifest.json").write_text(json.dumps(m))


def flip_byte(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt(kind, path):
    if kind == "flipped byte":
        flip_byte(path / "model.onnx.data")
    elif kind == "truncated":
        data = (path / "model.onnx.data").read_bytes()
        (path / "model.onnx.data").write_bytes(data[: len(data) // 2])
    elif kind == "missing file":
        (path / "tokenizer.json").unlink()
    elif kind == "wrong format version":
        edit_manifest(path, format_version=99)
    elif kind == "wrong architecture":
        edit_manifest(path, **{"model.architecture": "GPT2LMHeadModel"})
    elif kind == "foreign":
        (path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    elif kind == "corrupt manifest":
        (path / "manifest.json").write_text("{not json")
    elif kind == "no manifest":
        (path / "manifest.json").unlink()
    elif kind == "missing field":
        m = json.loads((path / "manifest.json").read_text())
        del m["model"]["num_layers"]
        (path / "manifest.json").write_text(json.dumps(m))
    elif kind == "wrong type":
        edit_manifest(path, **{"kv_cache.head_dim": "16"})
    elif kind == "inconsistent field":
        edit_manifest(path, **{"model.num_layers": 3})
    elif kind == "graph disagrees":
        edit_manifest(path, **{"model.head_dim": 8, "kv_cache.head_dim": 8})
    elif kind in NESTED:                        # inside a list or record: each ended in a traceback
        field, value = NESTED[kind]
        m = json.loads((path / "manifest.json").read_text())
        section, name, rest = field.split(".", 2) if field.startswith("graph.") else (*field.split("."), None)
        if rest is None:
            m[section][name] = value
        else:                                   # a graph record's name holds dots of its own
            m[section][name][rest] = value
        (path / "manifest.json").write_text(json.dumps(m))


# name → (field, value)
NESTED = {"tokenizer file not a name": ("tokenizer.files", [{"a": 1}]),
          "eos id not an id": ("tokenizer.eos_token_ids", [{}]),
          "logits shape not a list": ("graph.outputs.logits", {"dtype": "float32", "shape": 5}),
          "a layer's shape not a list": ("graph.inputs.past_key_values.{layer}.key", {"dtype": "float32", "shape": 16}),
          "session config not strings": ("precision.session_config", {"a": 1}),
          "unknown kv dtype": ("kv_cache.dtype", "nope"),
          "min_rows without block_size": ("precision.min_rows", "x")}


KINDS = ["flipped byte", "truncated", "missing file", "wrong format version", "wrong architecture", "foreign",
         "corrupt manifest", "no manifest", "missing field", "wrong type", "inconsistent field", "graph disagrees",
         *NESTED]
MESSAGES = {"flipped byte": "sha256", "truncated": "truncated", "missing file": "missing",
            "wrong format version": "format version", "wrong architecture": "GPT2LMHeadModel",
            "foreign": "not a Quicksilver engine", "corrupt manifest": "corrupted", "no manifest": "no manifest",
            "missing field": "invalid: field model.num_layers is missing",
            "wrong type": "invalid: field kv_cache.head_dim is '16'",
            "inconsistent field": "invalid: field kv_cache.num_layers is 2 but model.num_layers is 3",
            "graph disagrees": "invalid: graph.inputs.past_key_values.{layer}.key is",
            **{kind: f"invalid: field {field}".replace("{", "[{]").replace("}", "[}]")
               for kind, (field, _) in NESTED.items()}}


@pytest.mark.parametrize("kind", KINDS)
def test_load_rejects(kind, damaged):
    path = damaged()
    corrupt(kind, path)
    with pytest.raises(ArtifactError, match=MESSAGES[kind]):
        load(path)
    with pytest.raises(ArtifactError):
        ModelRunner(path)


@pytest.mark.parametrize("kind", KINDS)
def test_cli_one_line_exit_2(kind, damaged):
    path = damaged()
    corrupt(kind, path)
    for main, args in ((compile_main, ["inspect", str(path)]), (runtime_main, ["generate", str(path), "x"])):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.output
        assert "Traceback" not in result.output


def test_intact_engine_loads_and_inspects(engine):
    path = engine("llama")
    manifest = load(path)
    assert manifest["format_version"] == 1 and manifest["model"]["architecture"] == "LlamaForCausalLM"
    assert set(manifest["files"]) == {"model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json",
                                      "generation_config.json"}
    result = CliRunner().invoke(compile_main, ["inspect", str(path)])
    assert result.exit_code == 0 and "sha256 verified" in result.output
    result = CliRunner().invoke(compile_main, ["inspect", str(path), "--json"])
    assert json.loads(result.output)["kv_cache"]["layout"] == "BNSH"


def test_manifest_layers_checked_against_the_graph(damaged):
    """model.num_layers and kv_cache.num_layers changed together still disagree with the graph's inputs: the
    runtime's loader says so in one line (was an IndexError at generate)."""
    path = damaged()
    edit_manifest(path, **{"model.num_layers": 3, "kv_cache.num_layers": 3})
    load(path)   # consistent in itself; only the graph can tell
    with pytest.raises(ArtifactError, match=r"does not match model.onnx: the graph has no input "
                                            r"past_key_values.2.key \(field model.num_layers is 3\)"):
        ModelRunner(path)
    edit_manifest(path, **{"model.num_layers": 1, "kv_cache.num_layers": 1})
    with pytest.raises(ArtifactError, match=r"the graph has input past_key_values.1.key, which graph.inputs does "
                                            r"not declare \(field model.num_layers is 1\)"):
        ModelRunner(path)
    result = CliRunner().invoke(runtime_main, ["generate", str(path), "x"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [result.output.strip()] and "past_key_values.1.key" in result.output


def test_int4_integer_scales_engines_say_format_version_2_which_older_readers_refuse(checkpoint, tmp_path, monkeypatch):
    """An engine whose int4 linears carry integer block scales records format version 2: a reader from before them
    (version 1 only) refuses it with what to do, where its kernels, ignoring the packing's attribute, would otherwise
    compute garbage at the one K whose packed size matches the old packing's (128). Every other engine stays version 1,
    and this reader reads both."""
    import artifact
    from compile.build import build
    from compile.config import CompileConfig, QuantConfig

    built = {}
    for scales in ("int", "fp16"):
        cfg = CompileConfig(checkpoint("llama"), tmp_path / scales, "int4", report=False,
                            quant=QuantConfig(int4_scales=scales))
        built[scales] = (cfg, build(cfg, log=lambda _: None))
    cfg, manifest = built["int"]
    assert manifest["format_version"] == (2 if cfg.own_int4 else 1)
    assert built["fp16"][1]["format_version"] == 1
    for scales in built:
        assert load(tmp_path / scales)["format_version"] == built[scales][1]["format_version"]
    if cfg.own_int4:
        monkeypatch.setattr(artifact, "READABLE_FORMAT_VERSIONS", (1,))
        with pytest.raises(ArtifactError, match="format version 2.*upgrade Quicksilver"):
            load(tmp_path / "int")


def test_a_folder_swapped_after_verification_is_caught(engine, checkpoint, tmp_path):
    """Verified, then rebuilt in place (`compile build --overwrite` swaps the folder) before the loader opened its
    files by path: the loader would hold one build's manifest and the other's graph. check_unchanged, which the
    runner and the engine call once everything is open, names it."""
    from artifact import check_unchanged

    path = tmp_path / "engine"
    shutil.copytree(engine("llama"), path)
    manifest = load(path)
    check_unchanged(path, manifest)                        # nothing moved: quiet
    assert ModelRunner(path).manifest == manifest          # and a runner loads it (it checks too)
    result = CliRunner().invoke(compile_main, ["build", "--model", str(checkpoint("llama")), "--out", str(path),
                                               "--overwrite", "--no-report"])
    assert result.exit_code == 0, result.output
    with pytest.raises(ArtifactError, match="changed while it was being loaded"):
        check_unchanged(path, manifest)
    check_unchanged(path, load(path))                      # loaded again: quiet
