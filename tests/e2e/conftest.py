"""Fixtures shared by the real-weight tests: HF transformers loading the same GGUF file (the reference).

Each test module provides `gguf_file`; transformers dequantizes it with the same gguf library we use.
"""
import pytest
import torch


@pytest.fixture(scope="module")
def hf_tok(gguf_file):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
