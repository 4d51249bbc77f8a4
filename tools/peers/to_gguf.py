#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint to GGUF with llama.cpp's own converter (from the vendored llama.cpp of the
llama-cpp-python sdist), for side-by-side benchmarks with llama-server.

Our checkpoints' byte-level BPE tokenizers are trained locally, so llama.cpp does not know their pre-tokenizer
by hash and its converter refuses them; the pre-tokenizer they use (digits split one by one, then GPT-2's
byte-level regex) is the one llama.cpp calls "smollm", so an unknown hash maps to that (or $GGUF_PRE).

    python tools/peers/to_gguf.py LLAMA_CPP_DIR CKPT_DIR --outfile model-f32.gguf --outtype f32
"""

import os
import runpy
import sys


def main() -> None:
    llama_cpp = os.path.abspath(sys.argv[1])
    sys.path[:0] = [llama_cpp, os.path.join(llama_cpp, "gguf-py")]
    from conversion import base   # llama.cpp's converter package (newer layouts); older ones define it in the script

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return os.environ.get("GGUF_PRE", "smollm")

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    script = os.path.join(llama_cpp, "convert_hf_to_gguf.py")
    sys.argv = [script] + sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
