"""A tiny random-weight transformers DeepseekV4ForCausalLM (the V4_TINY config of test_deepseek_v4.py: hash-routed
first layer, CSA with its indexer and top-k 8, HCA ratio 128, sinks, YaRN) for the export and gradient-parity
tests, and how near its discrete choices come to a tie on given inputs."""
from __future__ import annotations

import numpy as np
import torch

from tests.parity.test_deepseek_v4 import V4_TINY


def build(seed: int = 0, **overrides):
    """fp32, eval mode; every parameter and buffer non-trivial: norms 1 + N(0, 0.3²), other weights N(0, 0.08²),
    the hash-routing table random experts, the routers' selection biases N(0, 0.1²) (as test_deepseek_v4)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    conf = {**V4_TINY, **overrides}
    torch.manual_seed(seed)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**conf)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale, shift = (0.3, 1.0) if "norm" in name else (0.08, 0.0)
            p.copy_(torch.randn(p.shape, generator=g) * scale + shift)
        for name, b in hf.named_buffers():
            if "tid2eid" in name:
                b.copy_(torch.randint(0, conf["n_routed_experts"], b.shape, generator=g))
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return hf


def nearest_ties(hf, ids) -> tuple[float, float]:
    """(the smallest gap between the k-th and (k+1)-th biased expert score of any token, the smallest gap at the
    indexer's top-k boundary of any query that sees more than top-k compressed entries) in HF's forward on ids.
    A choice that near a tie can flip with the last bits of either side's arithmetic: inputs are picked away from
    them, so that both sides make the same choices and everything downstream is comparable."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hm

    k, r = hf.config.index_topk, hf.config.compress_rates["compressed_sparse_attention"]
    router, indexer = [], []

    def scorer(self, *args):
        out = score(self, *args)
        S, N = out.shape[-2:]
        seen = torch.arange(N) < ((torch.arange(S) + 1) // r)[:, None]
        top = torch.sort(out.masked_fill(~seen, -torch.inf), dim=-1, descending=True).values
        if N > k:
            indexer.append(float((top[..., k - 1] - top[..., k])[..., seen.sum(-1) > k].min()))
        return out

    def route(self, h):
        out = topk(self, h)
        top = torch.sort(self.score_fn(out[0]) + self.e_score_correction_bias, dim=-1, descending=True).values
        router.append(float((top[:, self.top_k - 1] - top[:, self.top_k]).min()))
        return out

    score, topk = hm.DeepseekV4IndexerScorer.forward, hm.DeepseekV4TopKRouter.forward
    hm.DeepseekV4IndexerScorer.forward, hm.DeepseekV4TopKRouter.forward = scorer, route
    try:
        with torch.no_grad():
            hf(torch.as_tensor(ids, dtype=torch.long))
    finally:
        hm.DeepseekV4IndexerScorer.forward, hm.DeepseekV4TopKRouter.forward = score, topk
    assert router and indexer, "no routed layer or no binding top-k: the check would mean nothing"
    return min(router), min(indexer)
