"""Mistral: Llama's layout; every layer uses the sliding window when `sliding_window` is set."""
import dataclasses

from jaxmodels.families import _common as c, llama

NAMES = c.LLAMA_NAMES


def config(hf: dict):
    cfg = llama.config({"max_position_embeddings": 131072, **hf})
    w = hf.get("sliding_window", 4096)
    layer = dataclasses.replace(cfg.layers[0], attention=dataclasses.replace(cfg.layers[0].attention, window=w))
    return dataclasses.replace(cfg, family="mistral", layers=(layer,) * cfg.num_layers)
