"""A chat's prompts tokenized the way the servers do (runtime.prefix_tokenizer.PrefixTokenizer: a turn that extends
a recent prompt is tokenized from near that prompt's end) against the tokenizer's own `encode_batch` of the whole
text, interleaved prompt by prompt, with the ids compared every time.

The workload: `--users` chats behind one system prompt over held-out code, each turn the whole history plus a short
question and an answer, as a completion prompt (plain text) or a ChatML chat (`--chatml`: <|im_start|>/<|im_end|>
around every message, the added tokens a chat template puts in the text). With `--questions`, a RAG server's:
one document of `--system-chars` (the system message), then `--users` x `--turns` different questions after it,
each sharing only the document with the ones before. Prints per-prompt medians and the spread over prompts,
writes JSON with `--json`.

    python tools/bench_tokenize.py models/target/tokenizer.json --chatml
    python tools/bench_tokenize.py models/target/tokenizer.json --chatml --questions --system-chars 30000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.prefix_tokenizer import PrefixTokenizer  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "compile" / "data" / "heldout_code.txt"


def prompts(users: int, turns: int, system_chars: int, chatml: bool, seed: int = 0, questions: bool = False) -> list[str]:
    """Every user's prompt at every turn, users interleaved within a turn (as a server sees them); with
    `questions`, the document and one new question each."""
    text = TEXT.read_text()
    rng = np.random.default_rng(seed)

    def message(role: str, content: str) -> str:
        return f"<|im_start|>{role}\n{content}<|im_end|>\n" if chatml else f"\n# {role}:\n{content}"

    def snippet(n: int) -> str:
        start = int(rng.integers(0, len(text) - n))
        return text[start:start + n]

    if questions:
        header = "<|im_start|>assistant\n" if chatml else "\n# assistant:\n"
        return [message("system", text[:system_chars]) + message("user", f"question {i}: why is this here?\n"
                                                                  + snippet(90)) + header
                for i in range(users * turns)]
    histories = [message("system", text[:system_chars]) for _ in range(users)]
    out = []
    for turn in range(turns):
        for u in range(users):
            histories[u] += message("user", f"turn {turn}: what does this do?\n" + snippet(90))
            prompt = histories[u] + ("<|im_start|>assistant\n" if chatml else "\n# assistant:\n")
            out.append(prompt)
            histories[u] = prompt + snippet(120) + ("<|im_end|>\n" if chatml else "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer", type=Path, help="a tokenizer.json")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--system-chars", type=int, default=4000)
    ap.add_argument("--chatml", action="store_true", help="ChatML messages (added to the tokenizer if it lacks them)")
    ap.add_argument("--questions", action="store_true", help="one document, a new question after it each time")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer))
    if args.chatml:
        tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")
                                if tok.token_to_id(t) is None])
    prefix = PrefixTokenizer(tok)
    whole_ms, prefix_ms, chars = [], [], []
    for i, text in enumerate(prompts(args.users, args.turns, args.system_chars, args.chatml, questions=args.questions)):
        runs = {}
        for name in (("whole", "prefix") if i % 2 == 0 else ("prefix", "whole")):
            t = time.perf_counter()
            ids = tok.encode_batch([text])[0].ids if name == "whole" else prefix.encode(text)
            runs[name] = ((time.perf_counter() - t) * 1e3, ids)
        if runs["whole"][1] != runs["prefix"][1]:
            sys.exit(f"prompt {i}: PrefixTokenizer's ids differ from the tokenizer's own")
        whole_ms.append(runs["whole"][0])
        prefix_ms.append(runs["prefix"][0])
        chars.append(len(text))
    later = slice(1 if args.questions else args.users, None)   # what has an earlier prompt to share with
    ratios = np.array(prefix_ms[later]) / np.array(whole_ms[later])
    summary = {"prompts": len(chars), "chars_median": float(np.median(chars)),
               "tokens_last": len(runs["whole"][1]),
               "whole_ms_p50": float(np.median(whole_ms[later])), "prefix_ms_p50": float(np.median(prefix_ms[later])),
               "ratio_p50": float(np.median(ratios)), "ratio_p10": float(np.percentile(ratios, 10)),
               "ratio_p90": float(np.percentile(ratios, 90)), "ids_equal": True, "exact": prefix.exact}
    what = "questions after one document" if args.questions else f"chat, {args.users} users x {args.turns} turns"
    print(f"{args.tokenizer} ({'ChatML' if args.chatml else 'plain'} {what}, "
          f"prompts of {summary['chars_median']:.0f} characters median): follow-up prompts whole "
          f"{summary['whole_ms_p50']:.2f} ms, from a cut {summary['prefix_ms_p50']:.2f} ms "
          f"({summary['ratio_p50']:.2f}x [p10 {summary['ratio_p10']:.2f} - p90 {summary['ratio_p90']:.2f}]); "
          f"ids equal every prompt")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary},
                                        indent=1))


if __name__ == "__main__":
    main()
