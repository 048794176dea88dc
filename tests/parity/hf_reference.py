"""Tiny random-weight HF reference models (transformers, pinned) for parity tests.

Every parameter is randomised so that each feature actually moves the logits
(specs/hf_families.md §1.3): matrices N(0, 0.05²), biases and sinks N(0, 0.5²), norm weights
1 + N(0, 0.1²) — Gemma's (1+w) norms N(0, 0.1²).
"""
from __future__ import annotations

import torch
import transformers

# specs/hf_families.md §4, validated against an independent float64 reference.
TINY = {
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-05, "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64},
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "qwen3": {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 6,
              "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
    # Qwen2's layout as released: no head_dim (hidden / heads), no layer_types; layers i >= max_window_layers slide.
    # Two layers: at three, its large random q/k/v biases make greedy decoding repeat one token whatever the prompt
    "qwen2": {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    "mistral": {"model_type": "mistral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 4096, "sliding_window": 6,
                "tie_word_embeddings": False},
    "cohere": {"model_type": "cohere", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "layer_norm_eps": 1e-05,
               "rope_theta": 10000.0, "logit_scale": 0.25, "use_qk_norm": True, "tie_word_embeddings": True,
               "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 5, "eos_token_id": 6},
    "cohere2": {"model_type": "cohere2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "layer_norm_eps": 1e-05,
                "rope_theta": 50000.0, "logit_scale": 0.25, "sliding_window": 6,
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "tie_word_embeddings": True, "max_position_embeddings": 4096, "pad_token_id": 0, "bos_token_id": 5,
                "eos_token_id": 6},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                  "max_position_embeddings": 4096, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                  "tie_word_embeddings": False},
    "gemma3": {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "query_pre_attn_scalar": 24, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
               "sliding_window": 6,
               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "final_logit_softcapping": 2.0,
               "attn_logit_softcapping": None, "tie_word_embeddings": True, "max_position_embeddings": 4096,
               "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
    "gpt_oss": {"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 32,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-05,
                "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096},
                "max_position_embeddings": 131072, "swiglu_limit": 7.0, "tie_word_embeddings": False},
    "exaone4": {"model_type": "exaone4", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "rms_norm_eps": 1e-05, "sliding_window": 6, "sliding_window_pattern": "LLLG",
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "rope_theta": 1000000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                "max_position_embeddings": 131072, "tie_word_embeddings": False},
}

# Variants the spec asks for beside each base config (§4 "Variants to also run").
VARIANTS = {
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3_full": ("qwen3", {"use_sliding_window": False, "layer_types": None}),
    # sliding_window and max_window_layers still set (as Qwen2.5's config.json has them): HF slides no layer
    "qwen2_full": ("qwen2", {"use_sliding_window": False}),
    "mistral_full": ("mistral", {"sliding_window": None}),
    "cohere_noqk": ("cohere", {"use_qk_norm": False}),
    "qwen3_moe_norenorm": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2}),
    "exaone4_full": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4}),
    # 8 layers of a 5:1 plan: one scanned period of 6 plus a tail of 2
    "gemma3_tail": ("gemma3", {"num_hidden_layers": 8, "layer_types": (["sliding_attention"] * 5
                                                                      + ["full_attention"]) + ["sliding_attention"] * 2}),
    # 6 layers of an LLLG plan: one scanned period plus an unrolled tail of 2
    "cohere2_tail": ("cohere2", {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 3
                                 + ["full_attention"] + ["sliding_attention"] * 2}),
}


def tiny_config(name: str) -> dict:
    if name in VARIANTS:
        base, over = VARIANTS[name]
        cfg = {**TINY[base], **over}
        return {k: v for k, v in cfg.items() if v is not None or k in over}
    return dict(TINY[name])


def build(cfg: dict, seed: int = 0):
    """An fp32, eager-attention HF model with every parameter randomised."""
    cfg = dict(cfg)
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    return randomize(model, seed)


def randomize(model, seed: int = 0):
    """Every parameter non-trivial (module docstring); returns the model in fp32 eval mode."""
    torch.manual_seed(seed)
    model = model.float().eval()
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts.gate_up_proj" in name and not name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))  # GPT-OSS: large enough that the ±7 clamp fires
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif "norm" in name:
                p.copy_((0 if gemma else 1) + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def logits(model, ids, offset: int = 0):
    """fp32 logits of the HF model at positions offset .. offset+T-1."""
    ids = torch.as_tensor(ids)
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1) + offset
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos).logits.float().numpy()


def greedy(model, ids, n: int):
    """n greedy tokens from HF generate (EOS disabled so that all n are produced)."""
    with torch.no_grad():
        out = model.generate(torch.as_tensor(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()
