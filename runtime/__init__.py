"""Quicksilver runtime: loads engine artifacts and generates tokens (no PyTorch)."""

from pkgutil import extend_path

# Run from a checkout where the package is also installed (`pip install .`, then pytest or a Ray worker in the
# checkout), `runtime` is this folder while the compiled `runtime._native` (block hashing, our cpu ops) lives in
# the installed copy: look there too, after this folder.
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
