"""Issue #45 item 2: every file the loader opens is a listed, hashed path inside the engine folder.

A manifest that lists a path outside the folder, a graph or external data file the manifest does not list, and a
symlink that leaves the folder are each refused in one line (they used to load, and a tampered copy generated).
"""

import json
import os
import re
import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from compile.cli import main as compile_main
import artifact
from artifact import load, sha256_file
from runtime.cli import main as runtime_main
from artifact.errors import ArtifactError
from runtime.backends.cpu.runner import ModelRunner


@pytest.fixture
def copy(engine, tmp_path):
    def make(name="engine"):
        dst = tmp_path / name
        shutil.copytree(engine("llama"), dst)
        return dst
    return make


def edit(path, change):
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    (path / "manifest.json").write_text(json.dumps(m))


def listing(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def flip_weights(path: Path) -> None:
    data = bytearray((path / "model.onnx.data").read_bytes())
    data[-100] ^= 0xFF
    (path / "model.onnx.data").write_bytes(bytes(data))


def refused(path, needle, inspect=True):
    """ModelRunner and the CLIs (`compile inspect` unless not `inspect`: it does not open the graph) refuse `path`
    with one line that contains `needle`."""
    with pytest.raises(ArtifactError, match=re.escape(needle)):
        ModelRunner(path)
    commands = [(compile_main, ["inspect", str(path)])] if inspect else []
    for main, args in commands + [(runtime_main, ["generate", str(path), "x"])]:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output


def set_locations(path: Path, location: str) -> None:
    """Point every external initializer of model.onnx at `location`; re-list model.onnx with its new hash."""
    model = onnx.load(str(path / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    (path / "model.onnx").write_bytes(model.SerializeToString())
    edit(path, lambda m: m["files"].__setitem__("model.onnx", listing(path / "model.onnx")))


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_listed_file_outside_the_engine_is_refused(copy, tmp_path, how):
    """A listed `../../secret` or `/abs/secret` with the right size and sha256 used to load."""
    path = copy()
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0\n")
    rel = "../secret.txt" if how == "relative" else str(secret)
    edit(path, lambda m: m["files"].__setitem__(rel, listing(secret)))
    with pytest.raises(ArtifactError, match="outside the engine folder"):
        load(path, verify=False)
    refused(path, "outside the engine folder")


def test_etc_passwd_through_dotdot_is_refused(copy):
    path = copy()
    target = Path("/etc/hostname") if Path("/etc/hostname").is_file() else Path("/etc/passwd")
    rel = "../" * len(path.parts) + str(target).lstrip("/")
    edit(path, lambda m: m["files"].__setitem__(rel, listing(target)))
    refused(path, "outside the engine folder")


def test_graph_file_must_be_listed(copy):
    """graph.file "../out/model.onnx", an unlisted copy with flipped weights, loaded and generated."""
    path = copy()
    other = copy("out")
    flip_weights(other)
    edit(path, lambda m: m["graph"].__setitem__("file", "../out/model.onnx"))
    with pytest.raises(ArtifactError, match="graph.file"):
        load(path, verify=False)
    refused(path, "graph.file")


def test_unlisted_graph_inside_the_folder_is_refused(copy):
    path = copy()
    shutil.copyfile(path / "model.onnx", path / "spare.onnx")
    edit(path, lambda m: m["graph"].__setitem__("file", "spare.onnx"))
    refused(path, "spare.onnx")


@pytest.mark.parametrize("where", ["outside", "unlisted inside"])
def test_external_data_must_be_listed(copy, where):
    """The graph's initializers point at weights the manifest does not list (ONNX Runtime read them anyway)."""
    path = copy()
    if where == "outside":
        other = copy("out")
        flip_weights(other)
        location = "../out/model.onnx.data"
    else:
        shutil.copyfile(path / "model.onnx.data", path / "spare.data")
        flip_weights(path)                       # the listed data no longer matters: spare.data is read
        edit(path, lambda m: m["files"].__setitem__("model.onnx.data", listing(path / "model.onnx.data")))
        location = "spare.data"
    set_locations(path, location)
    load(path)                                   # every listed file is intact; only the graph's references are not
    refused(path, f"external data {location} is not a file the manifest lists", inspect=False)


def test_symlink_leaving_the_engine_is_refused(copy):
    path = copy()
    os.symlink("/", path / "rootlink")
    with pytest.raises(ArtifactError, match="rootlink"):
        load(path, verify=False)
    refused(path, "rootlink")


def test_listed_file_that_is_a_symlink_out_is_refused(copy, tmp_path):
    path = copy()
    outside = tmp_path / "tokenizer.json"
    shutil.move(path / "tokenizer.json", outside)
    os.symlink(outside, path / "tokenizer.json")
    refused(path, "outside the engine folder")


def test_a_file_the_runtime_reads_must_be_listed(copy):
    """generation_config.json is read by name: present but unlisted, it would steer sampling unhashed."""
    path = copy()
    edit(path, lambda m: m["files"].pop("generation_config.json"))
    refused(path, "generation_config.json")


def test_path_resolves_listed_files_only(copy):
    path = copy()
    manifest = load(path)
    assert artifact.path(path, manifest, "model.onnx") == (path / "model.onnx").resolve()
    for rel in ("missing.bin", "../engine/model.onnx", "/etc/passwd", "./model.onnx"):
        with pytest.raises(ArtifactError):
            artifact.path(path, manifest, rel)


def test_an_intact_engine_with_an_unlisted_plain_file_still_loads(copy):
    path = copy()
    (path / "README.txt").write_text("notes")
    ModelRunner(path)
