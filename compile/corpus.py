"""Python source corpus and byte-level BPE tokenizer shared by the training and checkpoint tools.

The corpus is the running interpreter's standard library, so every machine with the same CPython
version sees the same bytes and the split is reproducible. The held-out split is by file: a file is
held out when a hash of its path relative to the stdlib root falls in the held-out bucket, so no
function body of a held-out file is ever seen in training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]
MAX_FILE_BYTES = 200_000  # skip generated tables and giant data modules


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path | None = None) -> list[Path]:
    """Sorted .py files of the standard library (site-packages excluded), small enough to be code."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 0 < size <= MAX_FILE_BYTES:
            files.append(path)
    return files


def is_held_out(path: Path, root: Path | None = None, percent: int = 3) -> bool:
    rel = path.relative_to(root or stdlib_root()).as_posix()
    bucket = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "little") % 100
    return bucket < percent


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held_out) file lists, split by a hash of each file's relative path."""
    root = root or stdlib_root()
    train, held = [], []
    for path in python_files(root):
        (held if is_held_out(path, root) else train).append(path)
    return train, held


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any byte sequence round-trips, no unknown tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for a fast tokenizer with our special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
