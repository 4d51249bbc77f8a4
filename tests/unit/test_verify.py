"""`compile verify`: prompt bounds are usage errors, and quantized engines are judged by bounds that a broken
engine fails (it used to print "tolerance inf: PASS" whatever the logits were)."""

import json
import shutil

import numpy as np
import onnx
from click.testing import CliRunner

from artifact import MANIFEST, write_manifest
from compile.cli import main
from compile.verify import QUANTIZED_BOUNDS


def run_verify(engine, model, *extra):
    return CliRunner().invoke(main, ["verify", str(engine), "--model", str(model), *extra])


def scale_initializer(engine, name: str, factor: float) -> None:
    """Multiply a float32 initializer held in the external data file, then re-hash the artifact."""
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False).graph
    info = next({e.key: e.value for e in t.external_data} for t in graph.initializer if t.name == name)
    start, end = int(info["offset"]), int(info["offset"]) + int(info["length"])
    data = bytearray((engine / "model.onnx.data").read_bytes())
    data[start:end] = (np.frombuffer(bytes(data[start:end]), np.float32) * np.float32(factor)).tobytes()
    (engine / "model.onnx.data").write_bytes(bytes(data))
    manifest = json.loads((engine / MANIFEST).read_text())
    del manifest["files"]
    write_manifest(engine, manifest)


def test_prompt_len_must_be_positive_and_fit_the_context(engine, checkpoint):
    result = run_verify(engine("llama"), checkpoint("llama"), "--prompt-len", "0")
    assert result.exit_code == 2 and "'--prompt-len': 0 is not in the range x>=1" in result.output
    result = run_verify(engine("llama"), checkpoint("llama"), "--prompt-len", "5000")
    assert result.exit_code == 2, result.output
    assert result.output == "error: --prompt-len 5000 + --steps 16 exceed the engine's context of 512 tokens\n"


def test_broken_int8_engine_fails(engine, checkpoint, tmp_path):
    """The final norm's gain × 1.5 keeps 95 % of greedy choices but moves the logits by half their size."""
    good = run_verify(engine("llama", "int8"), checkpoint("llama"))
    assert good.exit_code == 0 and "top-1 agreement" in good.output and good.output.endswith(": PASS\n")
    broken = tmp_path / "broken"
    shutil.copytree(engine("llama", "int8"), broken)
    scale_initializer(broken, "/model/norm.weight", 1.5)
    result = run_verify(broken, checkpoint("llama"))
    assert result.exit_code == 1 and result.output.endswith("(≤ 0.35): FAIL\n"), result.output


def test_help_states_the_bounds():
    shown = " ".join(CliRunner().invoke(main, ["verify", "--help"]).output.split())
    for precision, (top1, rel) in QUANTIZED_BOUNDS.items():
        assert f"{precision} top-1 agreement ≥ {100 * top1:.0f} %, relative logit error ≤ {rel:.2f}" in shown
