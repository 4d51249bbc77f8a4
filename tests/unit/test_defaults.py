"""The bundled default engines: found from any folder, built once, rebuilt when their checkpoint changes."""

import json
import shutil
from pathlib import Path

import pytest

from compile.hf_source import fingerprint
from runtime import bundled as defaults

REPO = Path(__file__).resolve().parents[2]


def test_bundled_root_is_the_checkout_from_any_folder(tmp_path, monkeypatch):
    """Installed from the checkout (editable), models/ is found from any folder; a non-editable install (CI's
    `pip install .`) cannot know the checkout and says how to point at it. QUICKSILVER_HOME wins either way."""
    monkeypatch.delenv("QUICKSILVER_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(defaults, "REPO", REPO)                   # editable: the package runs from the checkout
    assert defaults.bundled_root() == REPO
    monkeypatch.setattr(defaults, "REPO", tmp_path / "site-packages")   # non-editable: it does not
    with pytest.raises(FileNotFoundError, match="QUICKSILVER_HOME"):
        defaults.bundled_root()
    monkeypatch.chdir(REPO)                                       # run from the checkout: found there
    assert defaults.bundled_root() == REPO
    monkeypatch.setenv("QUICKSILVER_HOME", str(tmp_path))
    assert defaults.bundled_root() == tmp_path


def test_engine_rebuilt_when_the_checkpoint_changes(checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("QUICKSILVER_ENGINE", raising=False)
    model = tmp_path / "models" / "target"
    shutil.copytree(checkpoint("llama"), model)
    engine = defaults.engine_dir("target", root=tmp_path)
    built = (engine / "manifest.json").stat().st_mtime_ns
    assert defaults.engine_dir("target", root=tmp_path) == engine
    assert (engine / "manifest.json").stat().st_mtime_ns == built                 # unchanged: not rebuilt
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    assert defaults.engine_dir("target", root=tmp_path) == engine
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["source"]["fingerprint"] == fingerprint(model) and manifest["model"]["max_seq_len"] == 256


def test_engine_rebuilt_when_its_graph_is_older_than_the_compiler(checkpoint, tmp_path, monkeypatch):
    """An engine whose manifest records an older graph revision (or none: from before the field) is rebuilt."""
    from compile.build import GRAPH_REVISION

    monkeypatch.delenv("QUICKSILVER_ENGINE", raising=False)
    shutil.copytree(checkpoint("llama"), tmp_path / "models" / "target")
    engine = defaults.engine_dir("target", root=tmp_path)
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["graph"]["revision"] == GRAPH_REVISION
    del manifest["graph"]["revision"]
    (engine / "manifest.json").write_text(json.dumps(manifest))
    assert defaults.engine_dir("target", root=tmp_path) == engine
    assert json.loads((engine / "manifest.json").read_text())["graph"]["revision"] == GRAPH_REVISION
