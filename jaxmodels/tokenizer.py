"""Text <-> token ids with the `tokenizers` library, plus the checkpoint's chat template (jinja2)."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from jaxmodels import chat_template, files
from jaxmodels.files import CheckpointError


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos: bool = False):
        self.tok = tok
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.tok.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return None if self.eos_token is None else self.tok.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return chat_template.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, text: str) -> list[int]:
        """A single user message, templated; the template already holds any BOS."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    # ----------------------------------------------------------------------------------- files
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.tok.save(str(directory / "tokenizer.json"))
        meta = {"chat_template": self.chat_template, "bos_token": self.bos_token, "eos_token": self.eos_token,
                "add_bos_token": self.add_bos}
        (directory / "tokenizer_config.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer | None":
        """The tokenizer of a checkpoint or converted directory (None without a tokenizer.json); its files are read
        with `jaxmodels.files`' rules: inside the directory, regular, bounded."""
        if (path := files.find(directory, "tokenizer.json")) is None:
            return None
        text = files.read_text(path, files.MAX_TOKENIZER_BYTES)
        try:
            tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise CheckpointError(f"{path}: not a tokenizer the `tokenizers` library can read ({e})") from None
        config = files.find(directory, "tokenizer_config.json")
        meta = {} if config is None else files.read_json(config, files.MAX_METADATA_BYTES)
        template = meta.get("chat_template")
        if template is None and (jinja := files.find(directory, "chat_template.jinja")) is not None:
            template = files.read_text(jinja, files.MAX_METADATA_BYTES)
        if isinstance(template, list):  # HF allows named templates; take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{config}: chat_template is neither a string nor a list of named templates")

        def token(key):
            v = meta.get(key)
            return v.get("content") if isinstance(v, dict) else v

        return cls(tok, template, token("bos_token"), token("eos_token"), bool(meta.get("add_bos_token", False)))
