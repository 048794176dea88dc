"""Batched generation: one jitted program runs the prefill and the whole decode loop on device."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels import model as M
from jaxmodels.distributed import to_host
from jaxmodels.sampling import Sampling, sample


@dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated part only, per prompt (stop token / sequence excluded)
    texts: list[str] | None  # decoded, when the model has a tokenizer
    prompt_tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the jitted program (includes compilation on first use)

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds if self.seconds else 0.0


def _bucket(n: int, minimum: int = 16) -> int:
    """Round lengths up to a power of two so that nearby prompt lengths share one compilation."""
    return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "sampling", "max_len", "unroll", "shard"))
def _generate(params, tokens, lengths, key, eos, *, cfg, max_new, sampling, max_len, unroll=1, shard=None):
    B = tokens.shape[0]
    cache = M.init_cache(cfg, B, max_len, params["embed"].dtype, shard=shard)  # allocated once, updated in place
    logits, cache = M.prefill(params, cfg, tokens, lengths, cache, shard=shard)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    out = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)

    def cond(state):
        step, _, _, done, _, _ = state
        return (step < max_new) & ~jnp.all(done)

    def body(state):
        step, tok, out, done, cache, key = state
        logits, cache = M.decode_step(params, cfg, tok, lengths + step - 1, cache, unroll, shard=shard)
        key, sub = jax.random.split(key)
        nxt = sample(logits, sub, sampling)
        nxt = jnp.where(done, 0, nxt)
        out = out.at[:, step].set(nxt)
        done = done | jnp.isin(nxt, eos)
        return step + 1, nxt, out, done, cache, key

    state = (jnp.int32(1), first, out, done, cache, key)
    step, _, out, _, _, _ = jax.lax.while_loop(cond, body, state)
    return out, step


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, seed: int = 0, stop=None,
             chat: bool = False, ignore_eos: bool = False, max_len: int | None = None,
             unroll: int | bool = 1) -> GenerateOutput:
    """Generate continuations for a batch of prompts (strings, or lists of token ids).

    chat: wrap each string prompt as one user message with the checkpoint's chat template.
    stop: strings (or token-id lists) that end a continuation; EOS tokens stop unless `ignore_eos`.
    max_len: cache length (default: prompt + max_new_tokens, rounded up to a power of two).
    unroll: unroll of the decode loop over layers. True reads each layer's weights in place and
        decodes ~2x faster on GPU (BENCHMARKS.md), at a compile time that grows with depth.
    """
    cfg, tok = model.config, model.tokenizer
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            ids.append(tok.encode_chat(p) if chat else tok.encode(p))
        else:
            ids.append([int(t) for t in p])
    if not ids or any(len(p) == 0 for p in ids):
        raise ValueError("every prompt needs at least one token")
    longest = max(map(len, ids))
    limit = cfg.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={limit}")
    T = min(_bucket(longest), limit)
    if max_len is not None and max_len < longest + max_new_tokens:
        raise ValueError(f"max_len={max_len} is shorter than prompt ({longest}) + max_new_tokens ({max_new_tokens})")
    max_len = max_len or min(_bucket(longest + max_new_tokens), limit)
    tokens = np.zeros((len(ids), T), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in ids], jnp.int32)
    sampling = Sampling(temperature, top_k, top_p, min_p)
    eos = set() if ignore_eos else set(cfg.eos_token_ids)
    if tok is not None and tok.eos_id is not None and not ignore_eos:
        eos.add(tok.eos_id)
    t0 = time.perf_counter()
    out, steps = _generate(model.params, jnp.asarray(tokens), lengths, jax.random.PRNGKey(seed),
                           jnp.asarray(sorted(eos) or [-1], jnp.int32), cfg=cfg, max_new=max_new_tokens,
                           sampling=sampling, max_len=max_len, unroll=unroll, shard=model.sharding)
    out = to_host(out)[:, : int(steps)]
    seconds = time.perf_counter() - t0
    results = [_cut(list(map(int, row)), eos, stop, tok) for row in out]
    texts = [tok.decode(r) for r in results] if tok is not None else None
    if texts is not None and stop:
        texts = [_cut_text(t, [s for s in stop if isinstance(s, str)]) for t in texts]
    return GenerateOutput(results, texts, ids, seconds)


def _cut(row: list[int], eos: set[int], stop, tok) -> list[int]:
    """Drop everything from the first EOS or stop sequence on."""
    end = next((i for i, t in enumerate(row) if t in eos), len(row))
    row = row[:end]
    for s in stop or ():
        seq = list(s) if not isinstance(s, str) else None
        if seq:
            for i in range(len(row) - len(seq) + 1):
                if row[i: i + len(seq)] == seq:
                    row = row[:i]
                    break
        elif tok is not None:  # a string: cut at the first token whose decoded prefix contains it
            for i in range(1, len(row) + 1):
                if s in tok.decode(row[:i]):
                    row = row[: i - 1]
                    break
    return row


def _cut_text(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]
