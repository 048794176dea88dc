"""Family registry: HF `model_type` -> (config mapping, checkpoint name map)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

from jaxmodels.config import ConfigError, ModelConfig
from jaxmodels.families import (cohere, deepseek_v4, exaone4, gemma3, gpt_oss, llama, mistral, mistral3, mllama,
                                qwen2, qwen3, qwen3_moe)


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
    untie: bool = False  # a checkpoint with its own lm_head is untied although config.json ties (as HF v5)


FAMILIES = {
    "llama": Family("llama", llama.config, llama.NAMES),
    "mistral": Family("mistral", mistral.config, mistral.NAMES),
    "qwen2": Family("qwen2", qwen2.config, qwen2.NAMES),
    "qwen3": Family("qwen3", qwen3.config, qwen3.NAMES),
    "cohere": Family("cohere", cohere.config, cohere.NAMES),
    "cohere2": Family("cohere2", cohere.config2, cohere.NAMES),
    "gemma3_text": Family("gemma3", gemma3.config, gemma3.NAMES, gemma3.SKIP),
    "gemma3": Family("gemma3", gemma3.config_multimodal, gemma3.names_multimodal, gemma3.VISION_SKIP, gemma3.RENAMES),
    "mllama": Family("mllama", mllama.config, mllama.names, renames=mllama.RENAMES),
    "mistral3": Family("mistral3", mistral3.config, mistral3.names, renames=mistral3.RENAMES, untie=True),
    "exaone4": Family("exaone4", exaone4.config, exaone4.NAMES, exaone4.SKIP),
    "exaone4_5": Family("exaone4", exaone4.config45, exaone4.names45, exaone4.SKIP45),
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


# config.json keys (any family, also in text_config and the rope dicts) -> the ModelConfig / spec field they
# become: integers, then numbers. Their types are checked before the mapping reads them; range errors of a field
# (config.validate) are reported under the key that holds the bad value.
HF_SIZES = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "intermediate_size": "intermediate_size", "moe_intermediate_size": "intermediate_size",
    "num_experts": "num_experts", "num_local_experts": "num_experts", "n_routed_experts": "num_experts",
    "num_experts_per_tok": "top_k", "experts_per_token": "top_k", "sliding_window": "window",
    "max_position_embeddings": "max_position_embeddings", "original_max_position_embeddings": "original_max_position",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank", "qk_rope_head_dim": "rope_dim",
    "index_n_heads": "index_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "hc_mult": "copies", "hc_sinkhorn_iters": "sinkhorn_iters",
}
HF_NUMBERS = {
    "rope_theta": "theta", "rope_local_base_freq": "theta", "compress_rope_theta": "theta", "factor": "factor",
    "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
    "beta_slow": "beta_slow", "rms_norm_eps": "norm_eps", "layer_norm_eps": "norm_eps", "logit_scale": "logit_scale",
    "final_logit_softcapping": "final_softcap", "query_pre_attn_scalar": "scale", "hc_eps": "eps",
    "swiglu_limit": "clamp_limit", "routed_scaling_factor": "route_scale",
}
HF_FIELDS = HF_SIZES | HF_NUMBERS
NULL_IS_MISSING = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _sections(hf: dict) -> list[dict]:
    """The dicts of a config.json that hold model numbers: the top level, text_config, their rope dicts."""
    out = [hf] + ([hf["text_config"]] if isinstance(hf.get("text_config"), dict) else [])
    for d in list(out):
        for k in ("rope_scaling", "rope_parameters"):
            if isinstance(d.get(k), dict):
                out += [d[k], *(v for v in d[k].values() if isinstance(v, dict))]
    return out


def _check_types(hf: dict, where: str) -> None:
    """Sizes are integers; the numbers positive and finite wherever they are written (a NaN theta beside the one
    the mapping reads is still a broken config)."""
    for d in _sections(hf):
        for k, v in d.items():
            if v is None or k not in HF_FIELDS:
                continue
            if k in HF_SIZES and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise ValueError(f"{where}: {k} must be an integer, got {v!r}")
            if k in HF_NUMBERS and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < math.inf):
                raise ValueError(f"{where}: {k} must be a positive finite number, got {v!r}")


def _without_nulls(hf: dict) -> dict:
    """A null core size reads as missing (the mapping's default, or its missing-field error)."""
    out = {k: v for k, v in hf.items() if v is not None or k not in NULL_IS_MISSING}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = _without_nulls(out["text_config"])
    return out


def _hf_key(hf: dict, e: ConfigError) -> str:
    """The config.json key behind a ConfigError: one that feeds the field and holds the bad value, else the field's
    only key if the value is missing, else (a value derived from others) the field itself."""
    same = lambda v: v == e.value or v != v and e.value != e.value  # noqa: E731 (NaN is NaN)
    keys = [k for k, f in HF_FIELDS.items() if f == e.field]
    return next((k for d in _sections(hf) for k, v in d.items() if k in keys and same(v)),
                keys[0] if e.value is None and len(keys) == 1 else e.field)


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a config.json dict; ValueError naming the field for a missing one or a value out of range."""
    mt = model_type(hf)
    family = get(mt)
    _check_types(hf, source)
    try:
        return family.config(_without_nulls(hf))
    except KeyError as e:
        raise ValueError(f"{source}: missing required field {e.args[0]!r} (model_type {mt!r})") from None
    except ConfigError as e:
        raise ValueError(f"{source}: {_hf_key(hf, e)} must be {e.want}, got {e.value!r}") from None
    except ValueError as e:
        raise ValueError(f"{source} (model_type {mt!r}): {e}") from None
    except TypeError as e:  # a required field that is null, or a list / dict where a number belongs
        raise ValueError(f"{source} (model_type {mt!r}): a field has a wrong value ({e})") from e


def name_map(family: Family, cfg: ModelConfig) -> dict:
    return family.names(cfg) if callable(family.names) else family.names
