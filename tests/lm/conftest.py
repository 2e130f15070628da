"""The second lane's tests: megatron-core 0.19 with ``megatron.training`` (Makefile: ``.venv-lm``).

The main lane's pytest leaves this folder out (pyproject.toml); ``pytest -c pytest-lm.ini``
runs it. A lane without ``megatron.training`` is a broken install, not a reason to skip."""

import importlib.metadata

from packaging.version import Version

_have = Version(importlib.metadata.version("megatron-core"))
if not (Version("0.19") <= _have < Version("0.20")):
    raise RuntimeError(f"tests/lm run on megatron-core 0.19.x (make venv-lm), found {_have}")
