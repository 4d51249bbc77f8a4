"""Streamed text deltas concatenate to the full decode and never split a UTF-8 character."""

from tokenizers import Tokenizer

from runtime.detokenizer import IncrementalDetokenizer


def test_stream_equals_full_decode(checkpoint):
    tok = Tokenizer.from_file(str(checkpoint("llama") / "tokenizer.json"))
    prompt = tok.encode("def f(x):\n").ids
    text = "    return 'naïve → 日本語 ✓ 🚀'  # done\n"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d]), "multi-byte characters span several tokens"
