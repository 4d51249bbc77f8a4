"""Write a deterministic random-weight Hugging Face checkpoint (compile.synthetic; run with --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile.synthetic import main  # noqa: E402

if __name__ == "__main__":
    main()
