"""Hostile checkpoints are contained (issue #17): chat templates are bounded in size and time, checkpoint files are
read only inside the checkpoint, only when regular and only up to a bound; ambiguous or malformed tensor tables
and GGUF token ids fail with an error naming the tensor, file or field.

Every hostile input here is refused before anything big is read or built, so each test takes well under a
second (the deadline test: its shortened deadline).
"""
import json
import os
import re
import time

import jinja2.sandbox
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file
from tokenizers import models, pre_tokenizers

import converters
from converters.safetensors_io import SafetensorsReader
from jaxmodels.tokenizer import Tokenizer

LLAMA = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>\nsecond line"},
            {"role": "assistant", "content": "Hello.",
             "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}]


def _word_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _render(template: str, messages=MESSAGES) -> str:
    return Tokenizer(_word_tokenizer(), template).apply_chat_template(messages)


# ------------------------------------------------------------------------------------------ chat templates
GROWING = {  # each builds ~100 MB or more; the unbounded renderer builds it in well under a second
    "repetition": "{{ 'A' * 100000000 }}",
    "doubling ~": "{% set ns = namespace(s='A') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                  "{{ ns.s|length }}",
    "padding filter": "{{ 'x'|center(100000000) }}",
    "padding method": "{{ 'x'.ljust(100000000) }}",
    "%-width": "{{ '%100000000s' % 'x' }}",
    "format width": "{{ '{:>100000000}'.format('x') }}",
    "replace": "{% set s = 'x' * 10000 %}{{ s|replace('x', s)|length }}",
    "join": "{% set s = 'x' * 10000 %}{{ range(10000)|join(s)|length }}",
    "nested references": "{% set ns = namespace(a=['x']) %}{% for i in range(30) %}{% set ns.a = [ns.a, ns.a] %}"
                         "{% endfor %}{{ ns.a|length }}",
    "output": "{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}",
    "macro output": "{% macro m() %}{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}{% endmacro %}"
                    "{{ m()|length }}",
    "source": "x" * (200 << 10),  # compiling alone takes seconds past ~100k characters
}


@pytest.mark.parametrize("template", GROWING.values(), ids=GROWING.keys())
def test_template_size_is_bounded(template):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="exceeded its bound"):
        _render(template)
    assert time.perf_counter() - t0 < 2, "refused only after building it"


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # prints nothing
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
])
def test_template_time_is_bounded(template, monkeypatch):
    from jaxmodels import chat_template

    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.3)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"exceeded its bound: still rendering after 0.3 s"):
        _render(template)
    assert time.perf_counter() - t0 < 3


def test_template_failures_are_value_errors():
    with pytest.raises(ValueError, match="refused the messages: roles must alternate"):
        _render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="SecurityError"):
        _render("{{ cycler.__init__.__globals__ }}")
    with pytest.raises(ValueError, match="TypeError"):
        _render("{{ 'a' + 1 }}")


REAL = """{%- macro fmt(m) -%}{{ m.role|upper }}{{ ':' ~ (m.content|trim|replace('\n', ' ')) }}{%- endmacro -%}
{%- set ns = namespace(sys='', n=0) -%}
{%- for m in messages if m.role == 'system' %}{% set ns.sys = ns.sys + m.content %}{% endfor -%}
<s>{{ '%-8s|' % 'system' }}{{ ns.sys|center(20) }}
{% for m in messages[1:] -%}
{{ loop.index }}/{{ loop.length }} {{ fmt(m) }}{{ ' (last)' if loop.last }}{{ loop.cycle('', '!') }}
{%- for call in m.tool_calls|default([]) %} {{ '{}({})'.format(call.function.name, call.function.arguments|tojson) }}
{%- for k, v in call.function.arguments|dictsort %} {{ k }}={{ v }}{% endfor %}{% endfor %}
{% endfor -%}
{{ messages|map(attribute='role')|join(', ') }} {{ [1, 2] * 2 }} {{ {'a': (1, 2)} }} {{ 2 ** 10 }}
{%- if add_generation_prompt %}{{ '\n<|assistant|>' }}{% endif %}"""


def test_ordinary_templates_render_as_before_and_fast():
    """The default model's template and one using most of jinja2: output as the unbounded sandbox's."""
    from converters.gguf_io import GGUFFile
    from jaxmodels import assets

    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    smollm = GGUFFile(assets.default_gguf()).fields["tokenizer.chat_template"]
    for template in (smollm, REAL):
        want = plain.from_string(template).render(messages=MESSAGES, add_generation_prompt=True, bos_token="",
                                                  eos_token="")
        assert _render(template) == want
        t0 = time.perf_counter()
        for _ in range(10):
            _render(template)
        assert (time.perf_counter() - t0) / 10 < 0.05, "rendering a template became slow"
    long = [MESSAGES[0]] + [{"role": "user", "content": "w" * 400_000}] * 50  # 20 MB: past MAX_CHARS, still fine
    assert len(_render(smollm, long)) > 20_000_000


# ------------------------------------------------------------------------------------ checkpoint files
def _checkpoint(d, tokenizer=True):
    """A minimal HF directory: config, one safetensors file, a tokenizer with a chat template."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(LLAMA))
    save_file({"model.embed_tokens.weight": np.ones((8, 8), np.float32)}, str(d / "model.safetensors"))
    if tokenizer:
        _word_tokenizer().save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "hi"}))
    return d


@pytest.fixture
def secret(tmp_path):
    s = tmp_path / "secret.txt"
    s.write_text("ssh-rsa PRIVATE")
    return s


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                  "model.safetensors"])
def test_a_file_linked_outside_the_checkpoint_is_refused(tmp_path, secret, name):
    src = _checkpoint(tmp_path / "ckpt")
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(secret)
    with pytest.raises(converters.CheckpointError, match=rf"{re.escape(name)}: resolves to .*outside the checkpoint"):
        converters.open_source(src)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_device_or_fifo_is_refused_without_reading(tmp_path, name):
    src = _checkpoint(tmp_path / "ckpt")
    (src / name).unlink()
    (src / name).symlink_to("/dev/zero")
    with pytest.raises(converters.CheckpointError, match="outside the checkpoint"):
        converters.open_source(src)
    (src / name).unlink()
    os.mkfifo(src / name)  # inside the checkpoint, but opening it would block forever
    with pytest.raises(converters.CheckpointError, match=rf"{re.escape(name)}: not a regular file"):
        converters.open_source(src)


def test_a_fifo_gguf_is_refused(tmp_path):
    os.mkfifo(tmp_path / "model.gguf")
    with pytest.raises(converters.CheckpointError, match="model.gguf: not a regular file"):
        converters.open_source(tmp_path / "model.gguf")


@pytest.mark.parametrize("name, size", [("config.json", (16 << 20) + 1), ("tokenizer.json", (256 << 20) + 1)])
def test_an_oversized_metadata_file_is_refused_before_it_is_read(tmp_path, name, size):
    src = _checkpoint(tmp_path / "ckpt")
    with open(src / name, "r+b") as f:
        f.truncate(size)  # sparse: nothing is written
    with pytest.raises(converters.CheckpointError, match=rf"{re.escape(name)}: {size:,} bytes, more than"):
        converters.open_source(src)


@pytest.mark.parametrize("entry", ["../x.safetensors", "/abs/x.safetensors"])
def test_an_index_entry_outside_the_checkpoint_is_refused(tmp_path, entry):
    src = _checkpoint(tmp_path / "ckpt")
    (src / "model.safetensors").rename(tmp_path / "x.safetensors")  # what `../x.safetensors` names: a real file
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": entry}}))
    with pytest.raises(converters.CheckpointError, match=re.escape(f"{entry!r} is not the name of a file inside")):
        converters.open_source(src)


def test_a_hugging_face_cache_snapshot_is_read(tmp_path, secret):
    """snapshots/<rev>/<file> -> ../../blobs/<hash>, as huggingface_hub lays the cache out: read; a link from
    the snapshot out of the models--org--name folder: refused."""
    repo = tmp_path / "hub" / "models--org--tiny"
    real = _checkpoint(tmp_path / "download")
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(real.iterdir())):
        f.rename(repo / "blobs" / f"{i:040x}")
        (snap / f.name).symlink_to(f"../../blobs/{i:040x}")
    (snap / "chat_template.jinja").write_text("{{ messages[0].content }}")  # a regular file: fine too
    cfg, reader, _, tok = converters.open_source(snap)
    assert cfg.family == "llama" and reader.keys() == ["model.embed_tokens.weight"]
    assert tok.eos_token == "hi" and tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo"
    (snap / "chat_template.jinja").unlink()
    (snap / "chat_template.jinja").symlink_to(os.path.relpath(secret, snap))
    with pytest.raises(converters.CheckpointError, match="chat_template.jinja: resolves to .*outside"):
        converters.open_source(snap)


def test_an_oversized_safetensors_header_is_refused_before_it_is_read(tmp_path):
    src = _checkpoint(tmp_path / "ckpt")
    with open(src / "model.safetensors", "wb") as f:
        f.write((200_000_000).to_bytes(8, "little"))
        f.truncate(300_000_000)  # sparse
    with pytest.raises(converters.CheckpointError, match=r"a safetensors header of 200,000,000 bytes \(at most"):
        converters.open_source(src)


# -------------------------------------------------------------------------------------------- tensors
def test_a_tensor_in_two_unindexed_shards_is_refused(tmp_path):
    for name, value in [("model-00001-of-00002.safetensors", 1.0), ("model-00002-of-00002.safetensors", 2.0)]:
        save_file({"w": np.full(2, value, np.float32), name[:11]: np.zeros(1, np.float32)}, str(tmp_path / name))
    with pytest.raises(converters.CheckpointError, match=r"tensor 'w' is in two files, model-00001-of-00002"
                                                         r"\.safetensors and model-00002-of-00002\.safetensors"):
        SafetensorsReader(tmp_path)


def test_with_an_index_the_file_it_names_holds_the_tensor(tmp_path):
    save_file({"w": np.full(2, 1.0, np.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"w": np.full(2, 2.0, np.float32), "v": np.zeros(1, np.float32)}, str(tmp_path / "b.safetensors"))
    index = {"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_array_equal(SafetensorsReader(tmp_path).get("w"), [1.0, 1.0])


# ----------------------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("field, value", [("eos_token_id", 99), ("bos_token_id", 8)])
def test_a_gguf_token_id_outside_the_vocabulary_is_named(tmp_path, field, value):
    import gguf

    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(5)])
    w.add_token_merges(["a b"])
    w.add_uint32(f"tokenizer.ggml.{field}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(converters.CheckpointError, match=rf"tokenizer\.ggml\.{field} = {value} is not a token id "
                                                         r"\(vocabulary of 8\)"):
        converters.open_source(path)
