"""Train the bundled code-completion pair: one byte-level BPE tokenizer, a target and a draft model.

Both models are LlamaForCausalLM and share the tokenizer. The target learns next-token prediction on
Python source of the standard library; the draft is distilled from the target (KL to its logits plus
cross-entropy) so that it agrees with the target as often as possible, which is what speculative
decoding pays for. Everything is seeded; the command line, data, time and figures go into each
model's MODEL_CARD.md.

    pip install '.[train]'
    python tools/train_demo.py --out models            # ~80 min on 2 CPU cores
    python tools/train_demo.py --out /tmp/m --target-steps 20 --draft-steps 20   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

EVAL_TEXT = Path(__file__).resolve().parents[1] / "compile" / "data" / "heldout_code.txt"
SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef list_files(path):",
                  "def quicksort(arr):", "    def __init__(self, name):"]


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    def config(self, vocab: int, max_pos: int, eos_id: int, pad_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, max_position_embeddings=max_pos,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
            torch_dtype="bfloat16",
        )


TARGET = Shape(hidden=512, layers=6, heads=8, kv_heads=4, ffn=1408)
DRAFT = Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=640)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokenize_files(tok, files: list[Path], eos_id: int) -> np.ndarray:
    """All files concatenated, each followed by EOS, as one uint16 token stream."""
    ids: list[int] = []
    texts = [t for t in (corpus.read_text(p) for p in files) if t]
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


def batches(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - seq - 1, size=batch)
        x = np.stack([stream[s:s + seq + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(model, stream, steps, lr, args, rng, teacher=None, tag="") -> list[float]:
    """AdamW with cosine decay under bf16 autocast; with a teacher, loss = KL(teacher‖model) + CE."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = batches(stream, args.batch, args.seq_len, rng)
    losses, t0 = [], time.time()
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        x = next(data)
        inputs, labels = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
            loss = ce
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=inputs).logits.float()
                kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1),
                              log_target=True, reduction="batchmean") / inputs.size(1)
                loss = kl + 0.5 * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ce.item())
        if step % 50 == 0 or step == steps - 1:
            rate = (step + 1) * args.batch * args.seq_len / (time.time() - t0)
            log(f"{tag} step {step + 1}/{steps} ce {np.mean(losses[-50:]):.3f} ({rate:.0f} tok/s)")
    model.eval()
    return losses


@torch.no_grad()
def held_out_loss(model, stream: np.ndarray, seq: int, max_windows: int = 256) -> float:
    """Mean next-token cross-entropy over non-overlapping held-out windows."""
    n = min(max_windows, (len(stream) - 1) // seq)
    total = 0.0
    for i in range(0, n, 16):
        rows = [stream[j * seq:(j * seq) + seq + 1] for j in range(i, min(n, i + 16))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                 reduction="sum").item()
    return total / (n * seq)


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos_id: int | None = None) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def speculative_acceptance(target, draft, stream, gamma=4, prompts=24, prompt_len=64, gen_len=64):
    """Fraction of draft proposals accepted under greedy speculation with `gamma` tokens per step.

    For each held-out prompt the target's greedy continuation is the truth; at every step the draft
    proposes `gamma` greedy tokens from the accepted prefix, the longest matching prefix is accepted
    and the target contributes one more token (the correction or bonus), as in real speculation.
    """
    proposed = accepted = 0
    stride = max(1, (len(stream) - prompt_len - 1) // prompts)
    for p in range(prompts):
        prompt = stream[p * stride:p * stride + prompt_len].astype(np.int64).tolist()
        truth = greedy(target, prompt, gen_len)
        pos = 0
        while pos < len(truth):
            guess = greedy(draft, prompt + truth[:pos], gamma)
            k = 0
            while k < len(guess) and pos + k < len(truth) and guess[k] == truth[pos + k]:
                k += 1
            proposed += len(guess)
            accepted += k
            pos += k + 1
    return accepted / max(1, proposed)


def save(model, tok, out: Path, max_pos: int, eos_id: int, pad_id: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(corpus.tokenizer_config(max_pos), indent=2))
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                     do_sample=False, max_new_tokens=128).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def write_card(out: Path, name: str, role: str, facts: dict, samples: dict[str, str]) -> None:
    lines = [f"# {name}", "", role, "", "## Facts", ""]
    lines += [f"- **{k}**: {v}" for k, v in facts.items()]
    lines += ["", "## Greedy completions (80 new tokens)", ""]
    for prompt, text in samples.items():
        lines += ["```python", prompt + text, "```", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--target-steps", type=int, default=1100)
    ap.add_argument("--draft-steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    t_start = time.time()
    max_pos = 2048

    root = corpus.stdlib_root()
    train_files, held_files = corpus.split_files(root)
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files under {root}")
    texts = [t for t in (corpus.read_text(p) for p in train_files) if t]
    tok = corpus.train_tokenizer(texts, args.vocab)
    eos_id, pad_id = tok.token_to_id(corpus.EOS_TOKEN), tok.token_to_id(corpus.PAD_TOKEN)
    train_ids = tokenize_files(tok, train_files, eos_id)
    held_ids = tokenize_files(tok, held_files, eos_id)
    log(f"tokenizer: vocab {tok.get_vocab_size()}; {len(train_ids):,} train / {len(held_ids):,} held-out tokens")

    # The default text of every engine's accuracy report (compile --eval), shipped inside the package.
    held_text = "\n".join(t for t in (corpus.read_text(p) for p in held_files) if t)
    EVAL_TEXT.write_text(held_text[:120_000])

    target = LlamaForCausalLM(TARGET.config(args.vocab, max_pos, eos_id, pad_id))
    t0 = time.time()
    train(target, train_ids, args.target_steps, args.lr, args, rng, tag="target")
    target_minutes = (time.time() - t0) / 60

    draft = LlamaForCausalLM(DRAFT.config(args.vocab, max_pos, eos_id, pad_id))
    t0 = time.time()
    train(draft, train_ids, args.draft_steps, args.draft_lr, args, rng, teacher=target, tag="draft")
    draft_minutes = (time.time() - t0) / 60

    log("evaluating")
    t_loss, d_loss = held_out_loss(target, held_ids, args.seq_len), held_out_loss(draft, held_ids, args.seq_len)
    acceptance = speculative_acceptance(target, draft, held_ids)
    samples = {}
    for model, name in ((target, "target"), (draft, "draft")):
        samples[name] = {p: tok.decode(greedy(model, tok.encode(p).ids, 80, eos_id)) for p in SAMPLE_PROMPTS}

    hw = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} CPU threads, no GPU"
    common = {
        "Architecture": "LlamaForCausalLM (tied embeddings, GQA), bf16 weights",
        "Tokenizer": f"byte-level BPE, vocab {tok.get_vocab_size()}, shared by draft and target",
        "Data": (f"Python {platform.python_version()} standard library ({len(train_files)} files, "
                 f"{len(train_ids):,} tokens); held out by file hash: {len(held_files)} files, "
                 f"{len(held_ids):,} tokens (sample in compile/data/heldout_code.txt)"),
        "Command": f"`{command}` (seed {args.seed}, batch {args.batch} x {args.seq_len} tokens)",
        "Hardware": hw,
        "Draft/target agreement": (f"{acceptance:.3f} of draft tokens accepted under greedy speculation "
                                   f"with gamma=4 on 24 held-out prompts (64 prompt + 64 generated tokens)"),
        "Trained on": time.strftime("%Y-%m-%d"),
    }
    for model, name, shape, loss, minutes, steps, role in (
        (target, "quicksilver-code-target", TARGET, t_loss, target_minutes, args.target_steps,
         "Target model of Quicksilver's bundled code-completion pair."),
        (draft, "quicksilver-code-draft", DRAFT, d_loss, draft_minutes, args.draft_steps,
         "Draft model of Quicksilver's bundled pair, distilled from the target for speculative decoding."),
    ):
        out = args.out / name.removeprefix("quicksilver-code-")
        params = save(model, tok, out, max_pos, eos_id, pad_id)
        facts = {"Parameters": f"{params / 1e6:.2f} M", "Shape": json.dumps(asdict(shape)),
                 "Training": f"{steps} steps, {steps * args.batch * args.seq_len:,} tokens, {minutes:.1f} min",
                 "Held-out loss": f"{loss:.4f} nats/token", "Held-out perplexity": f"{math.exp(loss):.2f}",
                 **common}
        write_card(out, name, role, facts, samples[name.split("-")[-1]])
        log(f"{name}: {params / 1e6:.2f} M params, held-out ppl {math.exp(loss):.2f}")
    summary = {"target_ppl": math.exp(t_loss), "draft_ppl": math.exp(d_loss), "acceptance_gamma4": acceptance,
               "target_minutes": target_minutes, "draft_minutes": draft_minutes,
               "total_minutes": (time.time() - t_start) / 60, "command": command}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    log(json.dumps(summary))


if __name__ == "__main__":
    main()
