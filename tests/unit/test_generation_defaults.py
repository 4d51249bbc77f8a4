"""Sampling defaults from the model's generation_config.json: `runtime generate` uses them for every option left
out (explicit options win), as transformers and vLLM do; `do_sample: false` means greedy."""

import json
import shutil

from click.testing import CliRunner

from compile.build import build
from compile.config import CompileConfig
from runtime.cli import main
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams, generation_defaults


def test_generation_defaults_read_the_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.2,
         "max_new_tokens": 99, "eos_token_id": 2, "min_p": "x"}))
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7,
                                                                   "repetition_penalty": 1.3}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                             "repetition_penalty": 1.3}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(tmp_path) == {}
    assert generation_defaults(tmp_path / "missing") == {}


def test_generate_uses_the_models_defaults_unless_told_otherwise(checkpoint, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(checkpoint("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 2.0}))
    build(CompileConfig(model, tmp_path / "engine", "fp32", report=False), log=lambda _: None)
    engine = Engine(tmp_path / "engine", EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=16 << 20)))
    prompt = "a b a b a b a b"
    with_model = engine.generate([prompt], SamplingParams(max_tokens=24, repetition_penalty=2.0))[0]["text"]
    plain = engine.generate([prompt], SamplingParams(max_tokens=24))[0]["text"]
    assert with_model != plain            # the penalty changes this text, so the comparison below can fail

    def cli(*extra):
        result = CliRunner().invoke(main, ["generate", str(tmp_path / "engine"), prompt, "--max-tokens", "24",
                                           "--no-stats", "--speculation", "off", *extra])
        assert result.exit_code == 0, result.output
        return result.output.rstrip("\n")[len(prompt):]

    assert cli() == with_model
    assert cli("--repetition-penalty", "1") == plain
