"""Write a deterministic random-weight Hugging Face checkpoint with a real trained byte-level BPE tokenizer.

Tiny presets feed the tests; realistic shapes (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) feed the benchmarks. Weights
are N(0, 0.02) from a seeded generator, so the same command always writes the same bytes.

    python tools/make_checkpoint.py --preset smollm2-135m --out /tmp/smollm2
    python tools/make_checkpoint.py --preset tiny-qwen2 --out /tmp/q --dtype bf16 --shards 2

Part of the package (not tools/) so that the tests' fixtures and the benchmarks share it without path tricks.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from . import corpus

PRESETS: dict[str, dict] = {
    "tiny-llama": dict(arch="LlamaForCausalLM", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, tied=False),
    "tiny-qwen2": dict(arch="Qwen2ForCausalLM", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, tied=True),
    # 128-wide heads: a cpu engine's KV rows tile a huge page at 4,096 tokens (tests of long-sequence KV)
    "tiny-llama-hd128": dict(arch="LlamaForCausalLM", hidden=256, layers=2, heads=2, kv_heads=1, ffn=256, vocab=512,
                             tied=False, max_pos=8192),
    "tiny-mistral": dict(arch="MistralForCausalLM", hidden=64, layers=2, heads=4, kv_heads=1, ffn=160, vocab=512,
                         tied=False, sliding_window=48),
    # the shapes of the bundled pair (tools/train_demo.py), for benchmarks without training
    "demo-target": dict(arch="LlamaForCausalLM", hidden=512, layers=6, heads=8, kv_heads=4, ffn=1408, vocab=8192,
                        tied=True, max_pos=2048),
    "demo-draft": dict(arch="LlamaForCausalLM", hidden=256, layers=2, heads=4, kv_heads=2, ffn=640, vocab=8192,
                       tied=True, max_pos=2048),
    "smollm2-135m": dict(arch="LlamaForCausalLM", hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536,
                         vocab=49152, tied=True, rope_theta=100000.0, max_pos=8192),
    "qwen2.5-0.5b": dict(arch="Qwen2ForCausalLM", hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864,
                         vocab=151936, tied=True, rope_theta=1000000.0, max_pos=32768),
    "qwen2.5-1.5b": dict(arch="Qwen2ForCausalLM", hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960,
                         vocab=151936, tied=True, rope_theta=1000000.0, max_pos=32768),
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}    # config.json's name for --dtype


def make_config(p: dict, eos_id: int, rope_scaling: dict | None, dtype: str = "fp32") -> dict:
    cfg = {
        "architectures": [p["arch"]], "model_type": MODEL_TYPES[p["arch"]],
        "hidden_size": p["hidden"], "num_hidden_layers": p["layers"], "num_attention_heads": p["heads"],
        "num_key_value_heads": p["kv_heads"], "intermediate_size": p["ffn"], "vocab_size": p["vocab"],
        "max_position_embeddings": p.get("max_pos", 512), "rms_norm_eps": 1e-5,
        "rope_theta": p.get("rope_theta", 10000.0), "rope_scaling": rope_scaling,
        "tie_word_embeddings": p["tied"], "hidden_act": "silu", "bos_token_id": eos_id, "eos_token_id": eos_id,
        "torch_dtype": TORCH_DTYPES[dtype], "attention_dropout": 0.0,
    }
    if p["arch"] == "MistralForCausalLM":
        cfg["sliding_window"] = p.get("sliding_window")
    if p["arch"] == "Qwen2ForCausalLM":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p["layers"])
    if p["arch"] == "LlamaForCausalLM":
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def make_weights(p: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd = p["hidden"] // p["heads"]

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(p["vocab"], p["hidden"]),
         "model.norm.weight": (1 + normal(p["hidden"], std=0.1))}
    for i in range(p["layers"]):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = 1 + normal(p["hidden"], std=0.1)
        w[pre + "post_attention_layernorm.weight"] = 1 + normal(p["hidden"], std=0.1)
        for name, out in (("q", p["heads"] * hd), ("k", p["kv_heads"] * hd), ("v", p["kv_heads"] * hd)):
            w[pre + f"self_attn.{name}_proj.weight"] = normal(out, p["hidden"])
            if p["arch"] == "Qwen2ForCausalLM":
                w[pre + f"self_attn.{name}_proj.bias"] = normal(out, std=0.1)
        w[pre + "self_attn.o_proj.weight"] = normal(p["hidden"], p["heads"] * hd)
        w[pre + "mlp.gate_proj.weight"] = normal(p["ffn"], p["hidden"])
        w[pre + "mlp.up_proj.weight"] = normal(p["ffn"], p["hidden"])
        w[pre + "mlp.down_proj.weight"] = normal(p["hidden"], p["ffn"])
    if not p["tied"]:
        w["lm_head.weight"] = normal(p["vocab"], p["hidden"])
    return w


def save_tensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """safetensors file in fp32, fp16 or bf16 (bf16 written as uint16 bits and relabelled in the header)."""
    if dtype == "fp16":
        tensors = {k: v.astype(np.float16) for k, v in tensors.items()}
    elif dtype == "bf16":
        tensors = {k: (v.view(np.uint32) + 0x8000 >> 16).astype(np.uint16) for k, v in tensors.items()}
    save_file(tensors, str(path))
    if dtype == "bf16":
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for k, v in header.items():
            if k != "__metadata__":
                v["dtype"] = "BF16"
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def write_checkpoint(preset: str, out: Path, seed: int = 0, dtype: str = "fp32", shards: int = 1,
                     rope_scaling: dict | None = None, tokenizer_vocab: int | None = None) -> Path:
    p = PRESETS[preset]
    out.mkdir(parents=True, exist_ok=True)
    files = corpus.python_files()[:400 if p["vocab"] <= 4096 else 1200]
    texts = [t for t in (corpus.read_text(f) for f in files) if t]
    tok = corpus.train_tokenizer(texts, min(tokenizer_vocab or p["vocab"], p["vocab"]))
    tok.save(str(out / "tokenizer.json"))
    eos_id = tok.token_to_id(corpus.EOS_TOKEN)
    (out / "tokenizer_config.json").write_text(json.dumps(corpus.tokenizer_config(p.get("max_pos", 512)), indent=2))
    (out / "config.json").write_text(json.dumps(make_config(p, eos_id, rope_scaling, dtype), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id}))
    weights = make_weights(p, seed)
    if shards == 1:
        save_tensors(weights, out / "model.safetensors", dtype)
        return out
    names = list(weights)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[s::shards]}
        save_tensors(part, out / fname, dtype)
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--rope-scaling", type=json.loads, default=None,
                    help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    ap.add_argument("--tokenizer-vocab", type=int, default=None, help="train a smaller BPE than the model vocab")
    args = ap.parse_args()
    path = write_checkpoint(args.preset, args.out, args.seed, args.dtype, args.shards, args.rope_scaling,
                            args.tokenizer_vocab)
    print(f"wrote {args.preset} checkpoint to {path}")


if __name__ == "__main__":
    main()
