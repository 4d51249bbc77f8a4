"""Train the bundled code-completion pair: one byte-level BPE tokenizer, a target and a draft model.

Both models are LlamaForCausalLM and share the tokenizer. The target learns next-token prediction on
Python source of the standard library; the draft is distilled from the target (DistillSpec-style:
KL(target‖draft) on the target's own samples and on the corpus) so that it agrees with the target as
often as possible, which is what speculative decoding pays for. Every batch is a pure function of
(seed, step), and a checkpoint is written every `--ckpt-every` steps, so an interrupted run resumes
where it stopped with the same result. The command line, data, time and figures go into each model's
MODEL_CARD.md and models/training_summary.json.

    pip install '.[train]'
    python tools/train_demo.py target --out models --init models/target --steps 1800   # continue training
    python tools/train_demo.py draft --out models --init models/draft --steps 800     # distil from it
    python tools/train_demo.py target --out /tmp/m --steps 20 && \\
        python tools/train_demo.py draft --out /tmp/m --steps 20                       # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile import corpus  # noqa: E402

EVAL_TEXT = Path(__file__).resolve().parents[1] / "compile" / "data" / "heldout_code.txt"
SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef list_files(path):",
                  "def quicksort(arr):", "    def __init__(self, name):"]
MAX_POS = 2048
GAMMAS = (1, 2, 4, 6)


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


SHAPES = {"target": Shape(hidden=512, layers=6, heads=8, kv_heads=4, ffn=1408),
          "draft": Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=640)}
ROLES = {"target": "Target model of Quicksilver's bundled code-completion pair.",
         "draft": "Draft model of Quicksilver's bundled pair, distilled from the target for speculative decoding."}


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


def windows(stream: np.ndarray, rows: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """`rows` random windows of seq+1 tokens; a pure function of (seed, step) so resuming is exact."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq - 1, size=rows)
    return torch.from_numpy(np.stack([stream[s:s + seq + 1] for s in starts]).astype(np.int64))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class Checkpoint:
    """Model + optimizer + step + loss history in one file, replaced atomically."""

    def __init__(self, path: Path | None):
        self.path = path

    def load(self, model, opt) -> tuple[int, list[float], float]:
        """(step, loss history, minutes trained) of the saved run, loaded into model and opt; (0, [], 0) if none."""
        if not self.path or not self.path.exists():
            return 0, [], 0.0
        state = torch.load(self.path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        log(f"resumed from {self.path} at step {state['step']}")
        return state["step"], state["losses"], state.get("minutes", 0.0)

    def save(self, model, opt, step: int, losses: list[float], extra: dict) -> None:
        if not self.path:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "losses": losses, **extra}, tmp)
        os.replace(tmp, self.path)


def train(model, next_batch, steps, lr, args, teacher=None, tag="", evaluate=None) -> tuple[list[float], float]:
    """AdamW with cosine decay (under bf16 autocast where the CPU has bf16 units); with a teacher,
    loss = KL(teacher‖model) + 0.1·CE.

    Returns the CE history and the minutes this invocation trained (a resumed run adds to the old)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt = Checkpoint(args.ckpt)
    start, losses, prior_minutes = ckpt.load(model, opt)
    forward = torch.compile(model) if args.compile else model
    model.train()
    t0 = time.time()
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, args.warmup)
        x = next_batch(step)
        inputs, labels = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = forward(input_ids=inputs).logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
            loss = ce
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=inputs).logits.float()
                kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1),
                              log_target=True, reduction="batchmean") / inputs.size(1)
                loss = kl + 0.1 * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ce.item())
        done = step + 1
        if done % 50 == 0 or done == steps:
            rate = (done - start) * x.numel() / (time.time() - t0)
            log(f"{tag} step {done}/{steps} ce {np.mean(losses[-50:]):.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"({rate:.0f} tok/s)")
        if done % args.ckpt_every == 0 or done == steps:
            minutes = prior_minutes + (time.time() - t0) / 60
            ckpt.save(model, opt, done, losses, {"minutes": minutes})
        if evaluate and (done % args.eval_every == 0 or done == steps):
            model.eval()
            log(f"{tag} step {done}: {evaluate()}")
            model.train()
    model.eval()
    return losses, prior_minutes + (time.time() - t0) / 60


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


def held_out_prompts(stream: np.ndarray, prompts: int, prompt_len: int) -> list[list[int]]:
    stride = max(1, (len(stream) - prompt_len - 1) // prompts)
    return [stream[p * stride:p * stride + prompt_len].astype(np.int64).tolist() for p in range(prompts)]


@torch.no_grad()
def greedy_acceptance(target, draft, prompts, gamma: int, gen_len: int = 64) -> float:
    """Fraction of draft proposals accepted under greedy speculation with `gamma` tokens per step.

    For each prompt the target's greedy continuation is the truth; at every step the draft proposes
    `gamma` greedy tokens from the accepted prefix, the longest matching prefix is accepted and the
    target contributes one more token (the correction or bonus), as in real speculation.
    """
    proposed = accepted = 0
    for prompt in prompts:
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


@torch.no_grad()
def sampled_acceptance(target, draft, prompts, gamma: int, temperature: float, seed: int,
                       gen_len: int = 64) -> float:
    """Fraction of draft proposals accepted by speculative rejection sampling at `temperature`.

    The draft samples `gamma` tokens from q; the target accepts token i with probability
    min(1, p/q), on a rejection samples from norm(max(0, p − q)) and stops, else adds a bonus
    token from p (Leviathan et al. 2023), so the output is distributed as the target's own.
    """
    gen = torch.Generator().manual_seed(seed)
    proposed = accepted = 0

    def probs(model, ids):
        return torch.softmax(model(input_ids=torch.tensor([ids])).logits[0].float() / temperature, -1)

    for prompt in prompts:
        ids = list(prompt)
        while len(ids) - len(prompt) < gen_len:
            guesses, qs = [], []
            for _ in range(gamma):
                q = probs(draft, ids + guesses)[-1]
                guesses.append(int(torch.multinomial(q, 1, generator=gen)))
                qs.append(q)
            p_all = probs(target, ids + guesses)[len(ids) - 1:]
            proposed += gamma
            for i, tok in enumerate(guesses):
                p, q = p_all[i], qs[i]
                if torch.rand((), generator=gen) < min(1.0, float(p[tok] / q[tok])):
                    ids.append(tok)
                    accepted += 1
                    continue
                residual = torch.clamp(p - q, min=0)
                ids.append(int(torch.multinomial(residual / residual.sum(), 1, generator=gen)))
                break
            else:
                ids.append(int(torch.multinomial(p_all[gamma], 1, generator=gen)))
    return accepted / max(1, proposed)


@torch.no_grad()
def target_samples(target, stream, rows: int, seq: int, seed: int, temperature: float = 1.0,
                   prompt_len: int = 32, batch: int = 32) -> np.ndarray:
    """The target's own continuations of corpus windows, `rows` × (seq + 1) tokens (DistillSpec's
    on-policy data: the draft learns the target where the target actually goes)."""
    torch.manual_seed(seed)
    out = []
    for b in range(0, rows, batch):
        prompts = windows(stream, min(batch, rows - b), prompt_len - 1, seed, 10_000_000 + b)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)            # T = 0: the target's greedy path, what greedy speculation verifies
        gen = target.generate(prompts, max_new_tokens=seq + 1 - prompt_len, pad_token_id=0, **sampling)
        out.append(gen[:, :seq + 1].numpy().astype(np.uint16))
        log(f"target samples: {b + len(prompts)}/{rows}")
    return np.concatenate(out)


def save(model, tok, out: Path, eos_id: int, pad_id: int, defaults: dict) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(corpus.tokenizer_config(MAX_POS), indent=2))
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
                     max_new_tokens=128, **defaults).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def write_card(out: Path, name: str, role: str, facts: dict, samples: dict[str, str], extra: list[str]) -> None:
    lines = [f"# {name}", "", role, "", "## Facts", ""]
    lines += [f"- **{k}**: {v}" for k, v in facts.items()]
    lines += extra
    lines += ["", "## Greedy completions (80 new tokens)", ""]
    for prompt, text in samples.items():
        lines += ["```python", prompt + text, "```", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(lines))


def load_model(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["target", "draft"],
                    help="target: next-token training; draft: distillation from OUT/target")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--init", type=Path, help="start from this checkpoint (and its tokenizer) instead of scratch")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (target 1800, draft 800)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (target 1e-3, draft 2e-3)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=8192, help="tokenizer vocabulary when training from scratch")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=1024, help="draft: target-sampled sequences to distil on, per temperature")
    ap.add_argument("--sample-temperatures", type=float, nargs="+", default=[1.0],
                    help="draft: temperatures of the target's samples (0: its greedy continuations)")
    ap.add_argument("--eval-prompts", type=int, default=24, help="draft: held-out prompts for acceptance")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="torch.compile the training forward (~12%% faster on 2 cores)")
    ap.add_argument("--ckpt", type=Path, default=None,
                    help="resume file (default ~/.cache/quicksilver/train/STAGE.pt)")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast [default: when the CPU has bf16 units (AVX512-BF16/AMX); emulated bf16 is "
                         "~40x slower than fp32 on an AVX2 machine]")
    ap.add_argument("--eval-every", type=int, default=250)
    args = ap.parse_args()
    stage = args.stage
    if args.bf16 is None:
        args.bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    args.steps = args.steps or {"target": 1800, "draft": 800}[stage]
    args.lr = args.lr or {"target": 1e-3, "draft": 2e-3}[stage]
    args.ckpt = args.ckpt or Path.home() / ".cache" / "quicksilver" / "train" / f"{stage}.pt"
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    root = corpus.stdlib_root()
    train_files, held_files = corpus.split_files(root)
    log(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files under {root}")
    tok_source = args.init if args.init else (args.out / "target" if stage == "draft" else None)
    if tok_source:
        tok = Tokenizer.from_file(str(tok_source / "tokenizer.json"))
    else:
        tok = corpus.train_tokenizer([t for t in (corpus.read_text(p) for p in train_files) if t], args.vocab)
    vocab = tok.get_vocab_size()
    eos_id, pad_id = tok.token_to_id(corpus.EOS_TOKEN), tok.token_to_id(corpus.PAD_TOKEN)
    train_ids = tokenize_files(tok, train_files, eos_id)
    held_ids = tokenize_files(tok, held_files, eos_id)
    log(f"tokenizer: vocab {vocab}; {len(train_ids):,} train / {len(held_ids):,} held-out tokens")
    # The default text of every engine's accuracy report (compile --eval), shipped inside the package.
    held_text = "\n".join(t for t in (corpus.read_text(p) for p in held_files) if t)
    EVAL_TEXT.write_text(held_text[:120_000])

    shape = SHAPES[stage]
    model = load_model(args.init) if args.init else LlamaForCausalLM(shape.config(vocab, MAX_POS, eos_id, pad_id))
    quick_eval = lambda: f"held-out ppl {math.exp(held_out_loss(model, held_ids, args.seq_len)):.2f}"  # noqa: E731
    facts_extra: list[str] = []
    summary_path = args.out / "training_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if stage == "target":
        losses, minutes = train(model, lambda s: windows(train_ids, args.batch, args.seq_len, args.seed, s),
                                args.steps, args.lr, args, tag="target", evaluate=quick_eval)
        defaults = {"do_sample": False, "repetition_penalty": 1.3}
    else:
        teacher = load_model(args.out / "target")
        pools = []
        for temperature in args.sample_temperatures:
            suffix = "" if temperature == 1.0 else f"-t{temperature:g}"
            samples_path = args.ckpt.with_name(f"samples-{args.samples}-{args.seed}{suffix}.npy")
            if not samples_path.exists():
                samples_path.parent.mkdir(parents=True, exist_ok=True)
                np.save(samples_path, target_samples(teacher, train_ids, args.samples, args.seq_len, args.seed,
                                                     temperature))
            pools.append(np.load(samples_path))
        own = np.concatenate(pools)
        half = args.batch // 2

        def mixed(step: int) -> torch.Tensor:
            rng = np.random.default_rng([args.seed, step, 1])
            sampled = torch.from_numpy(own[rng.integers(0, len(own), size=args.batch - half)].astype(np.int64))
            return torch.cat([windows(train_ids, half, args.seq_len, args.seed, step), sampled])

        losses, minutes = train(model, mixed, args.steps, args.lr, args, teacher=teacher, tag="draft",
                                evaluate=quick_eval)
        log("measuring acceptance")
        prompts = held_out_prompts(held_ids, args.eval_prompts, 64)
        greedy_acc = {g: greedy_acceptance(teacher, model, prompts, g) for g in GAMMAS}
        sampled_acc = {g: sampled_acceptance(teacher, model, prompts, g, 0.7, args.seed) for g in GAMMAS}
        for g in GAMMAS:
            log(f"gamma {g}: greedy {greedy_acc[g]:.3f}, T=0.7 {sampled_acc[g]:.3f}")
        facts_extra = ["", "## Acceptance of this draft's tokens by the target",
                       "", f"{args.eval_prompts} held-out prompts of 64 tokens, 64 generated tokens each; the fraction of proposed "
                       "draft tokens the target accepted (greedy: exact match; T=0.7: speculative rejection "
                       "sampling).", "", "| γ | greedy | T=0.7 |", "|---|---|---|"]
        facts_extra += [f"| {g} | {greedy_acc[g]:.3f} | {sampled_acc[g]:.3f} |" for g in GAMMAS]
        summary["acceptance"] = {"greedy": greedy_acc, "t0.7": sampled_acc}
        defaults = {"do_sample": False}

    loss = held_out_loss(model, held_ids, args.seq_len)
    texts = {p: tok.decode(greedy(model, tok.encode(p).ids, 80, eos_id)) for p in SAMPLE_PROMPTS}
    out = args.out / stage
    params = save(model, tok, out, eos_id, pad_id, defaults)
    tokens = args.steps * args.batch * args.seq_len
    facts = {
        "Parameters": f"{params / 1e6:.2f} M", "Shape": json.dumps(asdict(shape)),
        "Training": (f"{args.steps} steps, {tokens:,} tokens, {minutes:.1f} min"
                     + (f", starting from {args.init}" if args.init else ", from scratch")
                     + (f"; {args.samples} target-sampled sequences at each T in "
                        f"{', '.join(f'{t:g}' for t in args.sample_temperatures)} (0: greedy) make half of every batch"
                        if stage == "draft" else "")),
        "Loss": "KL(target‖draft) + 0.1 × cross-entropy" if stage == "draft" else "cross-entropy",
        "Held-out loss": f"{loss:.4f} nats/token", "Held-out perplexity": f"{math.exp(loss):.2f}",
        "Architecture": "LlamaForCausalLM (tied embeddings, GQA), bf16 weights",
        "Tokenizer": f"byte-level BPE, vocab {vocab}, shared by draft and target",
        "Data": (f"Python {platform.python_version()} standard library ({len(train_files)} files, "
                 f"{len(train_ids):,} tokens); held out by file hash: {len(held_files)} files, "
                 f"{len(held_ids):,} tokens (sample in compile/data/heldout_code.txt)"),
        "Command": f"`{command}` (seed {args.seed}, batch {args.batch} x {args.seq_len} tokens)",
        "Hardware": f"{platform.machine()}, {args.threads} CPU threads, no GPU, {'bf16 autocast' if args.bf16 else 'fp32'}",
        "Trained on": time.strftime("%Y-%m-%d"),
    }
    write_card(out, f"quicksilver-code-{stage}", ROLES[stage], facts, texts, facts_extra)
    summary[stage] = {"ppl": math.exp(loss), "steps": args.steps, "minutes": minutes, "command": command,
                      "final_train_ce": float(np.mean(losses[-50:]))}
    summary_path.write_text(json.dumps(summary, indent=2))
    log(f"{stage}: {params / 1e6:.2f} M params, held-out ppl {math.exp(loss):.2f}")


if __name__ == "__main__":
    main()
