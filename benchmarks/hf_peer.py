"""The HF transformers peer of the GPU benchmarks, for any causal LM transformers has a class for: a model of random
bf16 weights at a real shape, its eager prefill, and its decode (eager DynamicCache, or StaticCache with
torch.compile), each timed the same way whatever the family. bench_dense.py, bench_moe.py and bench.py use it.

Parametrised by the transformers model class (default: the config's `architectures[0]`) and the attention
implementation ("sdpa" for Llama; "eager" for GPT-OSS, which has no sdpa path). torch and transformers are imported
inside the functions, so the scripts that import this module still load without them.

Building blocks:      build, prefill, eager_decode, compiled_decode (with CompiledForward), timed_decode
Stages (old format):  stage_eager (torch ceilings, prefill, eager decode at each batch), stage_compile (compiled
                      decode at each batch); S["hf_steps"] / S["hf_reps"] where set, else S["decode_steps"] / S["reps"]
"""
from __future__ import annotations

import copy
import time

from _common import log, median_time, sync, torch_ceilings

COMPILED = "StaticCache + torch.compile(model.forward, mode='reduce-overhead', fullgraph=True); prefill eager"


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def build(hf: dict, attn: str, model_class: str | None = None):
    """(model, device, info): `model_class` (a transformers class name; default hf["architectures"][0]) built from
    the config dict `hf` with random bf16 weights, on cuda when there is one, attention implementation `attn`."""
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cls = getattr(transformers, model_class or hf["architectures"][0])
    conf = cls.config_class(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures", "torch_dtype")})
    conf._attn_implementation = attn
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = cls(conf)
        finally:
            torch.set_default_dtype(prev)
    model = model.to(dev, torch.bfloat16).eval()
    sync(dev)
    info = {"build_s": time.perf_counter() - t0, "attn_implementation": model.config._attn_implementation}
    experts = getattr(model.config, "_experts_implementation", None)
    if experts is not None and "num_local_experts" in hf:  # which MoE path transformers picked (grouped_mm / eager)
        info["experts_implementation"] = experts
    info["param_bytes"] = int(sum(p.numel() * p.element_size() for p in model.parameters()))
    log(f"[hf] {cls.__name__} {info['param_bytes'] / 1e9:.2f} GB built in {info['build_s']:.1f} s on {dev}: {info}")
    return model, dev, info


def timed_decode(step, reset, n: int, reps: int, warm: int = 4):
    """Median seconds of n decode steps, and every repetition's; reset() (untimed) restores the cache before each."""
    reset()
    step(warm)
    ts = []
    for _ in range(reps):
        reset()
        t0 = time.perf_counter()
        step(n)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], ts


def prefill(model, dev, T: int, reps: int, g) -> dict:
    """Eager prefill of one random [1, T] prompt (use_cache, logits of the last token only), after one warm-up call:
    median and every repetition. `g`: the torch.Generator the tokens come from."""
    import torch

    toks = torch.randint(0, model.config.vocab_size, (1, T), generator=g).to(dev)

    def pf():
        o = model(input_ids=toks, use_cache=True, logits_to_keep=1)
        sync(dev)
        return o
    with torch.inference_mode():
        pf()
        t, ts = median_time(pf, reps)
    log(f"[hf] eager prefill T={T}: {t * 1e3:.2f} ms, {T / t:.0f} tok/s")
    return {"batch": 1, "T": T, "ms": t * 1e3, "tokens_per_s": T / t, "rep_s": ts}


def eager_decode(model, dev, B: int, prompt: int, n: int, reps: int, g) -> dict:
    """Eager decode of one constant token per row for n steps after a `prompt`-token eager prefill into a DynamicCache,
    the cache restored from a copy (untimed) before each repetition."""
    import torch

    V = model.config.vocab_size
    with torch.inference_mode():
        ids = torch.randint(0, V, (B, prompt), generator=g).to(dev)
        tok = torch.randint(0, V, (B, 1), generator=g).to(dev)
        base = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        st = {}

        def reset():
            st["c"] = copy.deepcopy(base)
            sync(dev)

        def step(k):
            for _ in range(k):
                o = model(input_ids=tok, past_key_values=st["c"], use_cache=True)
            sync(dev)
            return o.logits
        t, ts = timed_decode(step, reset, n, reps)
    log(f"[hf] eager decode B={B}: {t / n * 1e3:.3f} ms/step, {B * n / t:.1f} tok/s")
    return {"batch": B, "steps": n, "step_ms": t / n * 1e3, "tokens_per_s": B * n / t, "rep_s": ts,
            "context": prompt, "mean_context": prompt + (n - 1) / 2, "cache_class": type(base).__name__}


class CompiledForward:
    """model.forward under torch.compile(mode="reduce-overhead", fullgraph=True); once a mode fails, the next one
    (fullgraph=False, then eager) for the rest of the process. `attempts` records each try."""
    MODES = (("compile reduce-overhead fullgraph", dict(mode="reduce-overhead", fullgraph=True)),
             ("compile reduce-overhead", dict(mode="reduce-overhead", fullgraph=False)),
             ("eager StaticCache", None))

    def __init__(self, model):
        self.model, self.i, self.attempts, self._fwd = model, 0, [], None

    @property
    def name(self) -> str:
        return self.MODES[self.i][0]

    @property
    def forward(self):
        import torch

        if self._fwd is None:
            kw = self.MODES[self.i][1]
            self._fwd = self.model.forward if kw is None else torch.compile(self.model.forward, **kw)
        return self._fwd

    def failed(self, batch: int, e: Exception) -> bool:
        """Record the failure and move to the next mode; False when none is left."""
        import torch

        self.attempts.append({"batch": batch, "mode": self.name, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
        log(f"[hf] {self.name} failed at B={batch}: {type(e).__name__}: {str(e)[:500]}")
        torch._dynamo.reset()
        self.i, self._fwd = self.i + 1, None
        return self.i < len(self.MODES)


def static_cache(model, B: int, cache_len: int, dev):
    import torch
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=cache_len)
    except TypeError:  # transformers before 5.x: batch, device and dtype up front
        return StaticCache(config=model.config, max_batch_size=B, max_cache_len=cache_len, device=dev,
                           dtype=torch.bfloat16)


def compiled_decode(cf: CompiledForward, dev, B: int, prompt: int, cache_len: int, n: int, reps: int, g,
                    contexts: list[int] | None = None) -> dict | list[dict] | None:
    """Decode through cf.forward on a StaticCache of `cache_len` slots: one constant token per row for n steps at
    positions prompt.. after an eager `prompt`-token prefill. Before each repetition (untimed) the cache is reset and
    the prompt prefilled again: transformers 5.24's static layers write at their own running length and ignore
    `cache_position`, so restarting the positions alone would not rewind them. The first 3 steps (compile, CUDA-graph
    record) are timed apart. Falls back through cf's modes on failure; None when all fail. With `contexts`, the same
    cache (same compiled graph) is then measured at each of those prompt lengths: a list of results, one per context."""
    import torch

    model, V = cf.model, cf.model.config.vocab_size
    ids = torch.randint(0, V, (B, max([prompt] + (contexts or []))), generator=g).to(dev)
    tok = torch.randint(0, V, (B, 1), generator=g).to(dev)
    while True:
        try:
            with torch.inference_mode():
                cache = static_cache(model, B, cache_len, dev)
                out = []
                for P in [prompt] + (contexts or []):
                    cps = [torch.tensor([P + i], device=dev) for i in range(max(n, 4))]
                    st = {"i": 0}

                    def reset(P=P):  # the cache holds the P-token prompt again; the next position is P
                        cache.reset()
                        model(input_ids=ids[:, :P], past_key_values=cache, use_cache=True,
                              cache_position=torch.arange(P, device=dev), logits_to_keep=1)
                        st["i"] = 0
                        sync(dev)

                    def step(k):
                        for _ in range(k):
                            o = cf.forward(input_ids=tok, past_key_values=cache, use_cache=True,
                                           cache_position=cps[st["i"]])
                            lg = o.logits
                            st["i"] += 1
                        sync(dev)
                        return lg
                    reset()
                    t0 = time.perf_counter()
                    step(3)  # compile + cudagraph warm-up/record (at the first context)
                    tc = time.perf_counter() - t0
                    t, ts = timed_decode(step, reset, n, reps)
                    out.append({"batch": B, "steps": n, "step_ms": t / n * 1e3, "tokens_per_s": B * n / t,
                                "rep_s": ts, "mode": cf.name, "compile_and_warmup_s": tc, "context": P,
                                "mean_context": P + (n - 1) / 2, "cache_slots": cache_len})
                    log(f"[hf] {cf.name} decode B={B} context {P} cache {cache_len}: {t / n * 1e3:.3f} ms/step, "
                        f"{B * n / t:.1f} tok/s (first 3 steps {tc:.1f} s)")
                del cache
        except Exception as e:  # noqa: BLE001  record it, try the next mode
            if not cf.failed(B, e):
                return None
            continue
        cf.attempts.append({"batch": B, "mode": cf.name, "ok": True})
        return out if contexts is not None else out[0]


# ------------------------------------------------------------------------------------ stages of bench_dense / bench_moe
def _steps_reps(S: dict) -> tuple[int, int]:
    return S.get("hf_steps", S["decode_steps"]), S.get("hf_reps", S["reps"])


def stage_eager(S: dict, out: dict, save, attn: str, model_class: str | None = None):
    """torch's ceilings (on cuda), the eager prefill at S["prefill_len"] and eager decode at each of S["batches"]
    (S["prompt"] tokens of context) -> out["hf_eager"]."""
    import torch

    r = out.setdefault("hf_eager", {})
    r["versions"] = versions()
    if torch.cuda.is_available():
        r["device"] = torch.cuda.get_device_name()
        r["ceilings"] = torch_ceilings(S, out)
        log(f"[hf] ceilings {r['ceilings']}")
        save()
    model, dev, info = build(S["hf"], attn, model_class)
    r.update(info)
    save()
    n, reps = _steps_reps(S)
    g = torch.Generator().manual_seed(0)
    r["prefill"] = prefill(model, dev, S["prefill_len"], reps, g)
    save()
    dec = {}
    for B in S["batches"]:
        d = eager_decode(model, dev, B, S["prompt"], n, reps, g)
        r["cache_class"] = d.pop("cache_class")
        dec[str(B)] = d
        r["decode"] = dec
        save()


def stage_compile(S: dict, out: dict, save, attn: str, model_class: str | None = None):
    """StaticCache (S["cache_len"] slots) + torch.compile decode at each of S["batches"] -> out["hf_compile"]; the
    mode that ran is in each result and `attempts` (fallbacks: fullgraph=False, then eager)."""
    import torch

    r = out.setdefault("hf_compile", {})
    model, dev, info = build(S["hf"], attn, model_class)
    r.update(info)
    r["mode"] = COMPILED
    cf = CompiledForward(model)
    r["attempts"] = cf.attempts
    n, reps = _steps_reps(S)
    g = torch.Generator().manual_seed(1)
    dec = {}
    for B in S["batches"]:
        d = compiled_decode(cf, dev, B, S["prompt"], S["cache_len"], n, reps, g)
        save()
        if d is None:
            break
        dec[str(B)] = d
        r["decode"] = dec
        save()


# ------------------------------------------------------------------------------- serving peer (continuous batching)
def generate_batch(model, prompts: list[list[int]], new: int, max_num_seqs: int, budget: int,
                   block_size: int = 256) -> dict:
    """transformers' continuous batching on `prompts` (`model.generate_batch`: its paged cache, scheduler and CUDA
    graphs where it decides), greedy, exactly `new` tokens each (no EOS), all arriving at once, at most
    `max_num_seqs` requests and `budget` tokens per batch (the engine's own limits). A short call on 8 of the prompts
    warms it up first (untimed). Output tok/s over the span from the first request's start to the last one's finish;
    TTFT (from that start) and inter-token latency from its per-token timestamps."""
    import numpy as np
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import dataclasses

    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Its default cache takes most of the card and leaves eager attention too little (OOM at 64 x 1024 on 5.17):
    # blocks for every row's whole sequence, as the engine's pool, plus one block a row of slack.
    blocks = max_num_seqs * (-(-(max(map(len, prompts)) + new) // block_size) + 1)
    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    for name in ("block_size", "num_blocks"):
        if name not in known:
            raise RuntimeError(f"this transformers' ContinuousBatchingConfig has no {name!r}")
    config = dict(block_size=block_size, num_blocks=blocks, max_batch_tokens=budget, max_requests_per_batch=max_num_seqs)
    cb = ContinuousBatchingConfig(**config)
    t0 = time.perf_counter()
    model.generate_batch(inputs=prompts[:8], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0), continuous_batching_config=cb)
    warm = time.perf_counter() - t0
    cb = ContinuousBatchingConfig(**config)
    t0 = time.perf_counter()
    outs = list(model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                     record_timestamps=True).values())
    wall = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error is not None]
    tokens = sum(len(o.generated_tokens) for o in outs)
    start, finish = min(o.lifespan[0] for o in outs), max(o.lifespan[1] for o in outs)
    ttft = np.array([o.timestamps[0] - start for o in outs if o.timestamps])
    itl = np.concatenate([np.diff(o.timestamps) for o in outs if o.timestamps and len(o.timestamps) > 1])
    r = {"requests": len(prompts), "finished": len(outs), "errors": errors[:3], "output_tokens": tokens,
         "expected_tokens": len(prompts) * new, "warmup_s": round(warm, 1), "wall_s": round(wall, 2),
         "span_s": round(finish - start, 2), "output_tok_s": round(tokens / (finish - start), 1),
         "output_tok_s_wall": round(tokens / wall, 1),
         "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3), "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
         "itl_p50_ms": round(1e3 * float(np.percentile(itl, 50)), 2),
         "itl_p99_ms": round(1e3 * float(np.percentile(itl, 99)), 2),
         "config": config | {"attn": model.config._attn_implementation}}
    log(f"[hf] generate_batch {len(prompts)} x {len(prompts[0])} -> {new}: {r}")
    return r
