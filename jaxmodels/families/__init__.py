"""Family registry: HF `model_type` -> (config mapping, checkpoint name map)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from jaxmodels.config import ModelConfig
from jaxmodels.families import cohere, deepseek_v4, exaone4, gemma3, gpt_oss, llama, mistral, qwen3, qwen3_moe


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[dict], ModelConfig]
    names: dict | Callable[[ModelConfig], dict]  # tensor name regex -> (param path, transform), or a
    #                                             function of the config that returns that map
    skip: tuple[str, ...] = ()  # checkpoint entries this family leaves out on purpose (vision, MTP)
    renames: tuple | None = None  # (regex, replacement) applied to checkpoint names before the map (None: the
    #                               multimodal-wrapper prefixes)
    derived: tuple[str, ...] = ()  # parameters not read from the checkpoint (built at import)
    quantized: bool = False  # FP8/FP4 weights with `.scale` beside them (converters/deepseek.py decodes them)


FAMILIES = {
    "llama": Family("llama", llama.config, llama.NAMES),
    "mistral": Family("mistral", mistral.config, mistral.NAMES),
    "qwen3": Family("qwen3", qwen3.config, qwen3.NAMES),
    "cohere": Family("cohere", cohere.config, cohere.NAMES),
    "cohere2": Family("cohere2", cohere.config2, cohere.NAMES),
    "gemma3_text": Family("gemma3", gemma3.config, gemma3.NAMES, gemma3.SKIP),
    "gemma3": Family("gemma3", gemma3.config_multimodal, gemma3.NAMES, gemma3.SKIP),
    "exaone4": Family("exaone4", exaone4.config, exaone4.NAMES, exaone4.SKIP),
    "exaone4_5": Family("exaone4", exaone4.config45, exaone4.NAMES, exaone4.SKIP),
    "qwen3_moe": Family("qwen3_moe", qwen3_moe.config, qwen3_moe.NAMES),
    "gpt_oss": Family("gpt_oss", gpt_oss.config, gpt_oss.NAMES),
    "gpt_oss_original": Family("gpt_oss", gpt_oss.config_original, gpt_oss.original_names),
    **{t: Family(t, deepseek_v4.config, deepseek_v4.NAMES, deepseek_v4.SKIP, deepseek_v4.RENAMES, deepseek_v4.DERIVED,
                 quantized=True) for t in (deepseek_v4.V4, deepseek_v4.V41)},
}


def get(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"unknown architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}") from None


def model_type(cfg_json: dict) -> str:
    """The registry key of a config.json (HF `model_type`, or a recognised non-HF layout)."""
    if gpt_oss.is_original(cfg_json):
        return "gpt_oss_original"
    if "model_type" not in cfg_json:
        raise ValueError("config.json has no 'model_type'; cannot tell the architecture")
    return cfg_json["model_type"]


def config_from_hf(hf: dict) -> ModelConfig:
    return get(model_type(hf)).config(hf)


def name_map(family: Family, cfg: ModelConfig) -> dict:
    return family.names(cfg) if callable(family.names) else family.names
