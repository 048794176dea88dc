"""Batched generation: one jitted program runs the prefill and the whole decode loop on device."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels import model as M, multimodal, sharding, speculative
from jaxmodels.layers import vision as _vision
from jaxmodels.distributed import to_host
from jaxmodels.sampling import Sampling, is_int, sample
from jaxmodels.speculative import stopped


@dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated part only, per prompt (stop token / sequence excluded)
    texts: list[str] | None  # decoded, when the model has a tokenizer
    prompt_tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the jitted program (includes compilation on first use)
    # speculative decoding (num_speculative_tokens > 0), summed over rows; None otherwise
    acceptance_rate: float | None = None  # drafts the rejection rule accepted / drafts proposed
    tokens_per_step: float | None = None  # tokens emitted per verify step and row (at most accepted drafts + 1)

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds if self.seconds else 0.0


def _bucket(n: int, minimum: int = 16) -> int:
    """Round lengths up to a power of two so that nearby prompt lengths share one compilation."""
    return max(minimum, 1 << (n - 1).bit_length())


def _stop_table(seqs: list[list[int]]) -> np.ndarray:
    """Stop id sequences [S, L], right-aligned; -1 pads on the left match anything. S and L are rounded up to
    powers of two (at least 4 x 8) so that most stop lists share one compilation; the padding rows end in -3,
    which no tail holds, and never match."""
    L = _bucket(max(map(len, seqs), default=1), 8)
    table = np.full((_bucket(len(seqs), 4), L), -1, np.int32)
    table[len(seqs):, -1] = -3
    for i, q in enumerate(seqs):
        table[i, L - len(q):] = q
    return table


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "sampling", "max_len", "unroll", "shard", "static"),
                   compiler_options=M.COMPILER_OPTIONS)
def _generate(params, tokens, lengths, key, eos, stops=None, images=None, *, cfg, max_new, sampling, max_len, unroll=1,
              shard=None, static=()):
    B = tokens.shape[0]
    stops = jnp.asarray(_stop_table([])) if stops is None else stops
    images = {**(images or {}), **dict(static)}
    cross = 0  # Mllama: the image-feature tokens each sequence's cross-attention layers keep
    if cfg.vision is not None and cfg.vision.kind == "mllama" and "pixel_values" in images:
        v = cfg.vision
        cross = images["pixel_values"].shape[1] * v.max_tiles * ((v.image_size // v.patch_size) ** 2 + 1)
    cache = M.init_cache(cfg, B, max_len, params["embed"].dtype, shard=shard, cross_tokens=cross)  # updated in place
    logits, cache = M.prefill(params, cfg, tokens, lengths, cache, shard=shard, images=images or None)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    out = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(first)
    tail = jnp.full((B, stops.shape[1]), -2, jnp.int32).at[:, -1].set(first)  # the last L tokens, for stops
    done = jnp.isin(first, eos) | stopped(tail, stops)

    def cond(state):
        step, _, _, _, done, _, _ = state
        return (step < max_new) & ~jnp.all(done)

    def body(state):
        step, tok, out, tail, done, cache, key = state
        logits, cache = M.decode_step(params, cfg, tok, lengths + step - 1, cache, unroll, shard=shard)
        key, sub = jax.random.split(key)
        nxt = sample(logits, sub, sampling)
        nxt = jnp.where(done, 0, nxt)
        out = out.at[:, step].set(nxt)
        tail = jnp.concatenate([tail[:, 1:], nxt[:, None]], axis=1)
        done = done | jnp.isin(nxt, eos) | stopped(tail, stops)  # a done row idles; the others go on
        return step + 1, nxt, out, tail, done, cache, key

    state = (jnp.int32(1), first, out, tail, done, cache, key)
    step, _, out, _, _, _, _ = jax.lax.while_loop(cond, body, state)
    return out, step


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, seed: int = 0, stop=None,
             chat: bool = False, ignore_eos: bool = False, max_len: int | None = None,
             unroll: int | bool = 1, images=None, num_speculative_tokens: int = 0) -> GenerateOutput:
    """Generate continuations for a batch of prompts (strings, or lists of token ids).

    chat: wrap each string prompt as one user message with the checkpoint's chat template.
    images: a vision model's images, one list per prompt (PIL images, paths, bytes, data: URIs or arrays),
        processed as the family's HF processor does; each prompt's image placeholders (see
        `jaxmodels.multimodal`) are expanded into the image's tokens, or put in front when it has none.
    stop: a string, or a list of strings / token-id lists, each ending a continuation (excluded from it); a row
        ends on device once its last tokens are a stop's ids. EOS tokens stop unless `ignore_eos`.
    max_len: cache length (default: prompt + max_new_tokens, rounded up to a power of two), at most the
        model's max_position_embeddings.
    unroll: `lax.scan`'s unroll of the decode loop over layers (1: scanned, compile time independent of depth;
        unrolling no longer buys speed on GPU, see `model.COMPILER_OPTIONS`).
    num_speculative_tokens: k > 0 decodes speculatively with the model's own draft heads (DeepSeek V4.1's DSpark,
        k <= its block size; V4's classic MTP, applied recursively): each step the drafter proposes k tokens and
        one target pass over k+1 positions verifies them (`jaxmodels.speculative`). Greedy output is the plain
        decode's, token for token (up to fp rounding between one-token and chunked passes); sampled output has
        the target's distribution (the standard rejection rule). The result's `acceptance_rate` and
        `tokens_per_step` report how well the drafter did. Needs the MTP parameters (params["mtp"]); no images.

    Token ids must be ints in [0, vocab_size); bad ids, stops and sampling arguments raise ValueError.
    """
    cfg, tok = model.config, model.tokenizer
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or (len(prompts) and is_int(prompts[0])):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not is_int(seed) or not 0 <= seed < 2**32:  # PRNGKey keeps 32 bits: larger or negative seeds collide
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    sampling = Sampling(temperature, top_k, top_p, min_p)
    k = num_speculative_tokens
    if not is_int(k) or k < 0:
        raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
    if k and (cfg.mtp is None or "mtp" not in model.params):
        raise ValueError(f"num_speculative_tokens={k} needs a model with MTP draft heads (DeepSeek V4 / V4.1 loaded "
                         f"with its mtp.* tensors); {cfg.family} has none")
    if k and cfg.mtp.kind == "dspark" and k > cfg.mtp.block_size:
        raise ValueError(f"num_speculative_tokens={k} exceeds the DSpark block size {cfg.mtp.block_size}")
    if k and images is not None:
        raise ValueError("num_speculative_tokens does not support images")
    if not len(prompts):
        raise ValueError("no prompts given")
    vision = {}
    if images is not None:
        if not isinstance(images, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in images):
            raise ValueError("images must be a list with one list of images per prompt")
        prompts, vision = _with_images(model, prompts, images, chat)
    ids = [_prompt_ids(i, p, tok, chat, cfg.vocab_size) for i, p in enumerate(prompts)]
    stops = _stops(stop, tok, cfg.vocab_size)
    longest = max(map(len, ids))
    limit = cfg.max_position_embeddings
    need = longest + max_new_tokens + k  # a verify step may run k positions past the last emitted token
    extra = f" + num_speculative_tokens={k}" if k else ""
    if need > limit:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens}{extra} exceeds the model's "
                         f"max_position_embeddings={limit}")
    if max_len is not None and (not is_int(max_len) or not need <= max_len <= limit):
        raise ValueError(f"max_len={max_len!r} must be an int between prompt ({longest}) + max_new_tokens "
                         f"({max_new_tokens}){extra} and the model's max_position_embeddings={limit}")
    max_len = max_len or min(_bucket(need), limit)
    T = min(_bucket(longest), limit)
    tokens = np.zeros((len(ids), T), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in ids], np.int32)  # host arrays: created inside no one's context mesh
    eos = set() if ignore_eos else eos_ids(cfg, tok)
    if vision and cfg.vision.kind == "siglip":  # Gemma3's processor marks the soft tokens: bidirectional there
        vision["token_type_ids"] = (tokens == cfg.vision.image_token_id).astype(np.int32)
    if "cross_attention_mask" in vision:  # Mllama: per prompt token, padded like the prompts
        m = vision["cross_attention_mask"]
        vision["cross_attention_mask"] = np.pad(m, ((0, 0), (0, T - m.shape[1]), (0, 0), (0, 0)))
    arrays, static = _vision.inputs(cfg, tokens, vision)
    t0 = time.perf_counter()
    stats = None
    with sharding.entered(model.sharding):
        if k:
            out, steps, stats = speculative.generate(
                model.params, tokens, lengths, np.asarray(jax.random.PRNGKey(seed)),
                np.asarray(sorted(eos) or [-1], np.int32), _stop_table([q for _, q in stops if q]), cfg=cfg,
                max_new=max_new_tokens, sampling=sampling, max_len=max_len, k=k, shard=model.sharding)
        else:
            out, steps = _generate(model.params, tokens, lengths, np.asarray(jax.random.PRNGKey(seed)),
                                   np.asarray(sorted(eos) or [-1], np.int32),
                                   _stop_table([q for _, q in stops if q]), arrays or None, cfg=cfg,
                                   max_new=max_new_tokens, sampling=sampling, max_len=max_len, unroll=unroll,
                                   shard=model.sharding, static=static)
    out = to_host(out)[:, : int(steps)]
    seconds = time.perf_counter() - t0
    results = [_cut(list(map(int, row)), eos, stops, tok) for row in out]
    texts = [tok.decode(r) for r in results] if tok is not None else None
    if texts is not None and stops:
        texts = [_cut_text(t, [s for s, _ in stops if s is not None]) for t in texts]
    result = GenerateOutput(results, texts, ids, seconds)
    if stats is not None:
        row_steps, proposed, accepted, emitted = (int(v) for v in to_host(stats))
        result.acceptance_rate = accepted / proposed if proposed else 0.0
        result.tokens_per_step = emitted / row_steps if row_steps else 0.0
    return result


def _with_images(model, prompts, images, chat: bool) -> tuple[list[list[int]], dict]:
    """The prompts' token ids with their images' placeholders expanded (chat: each one user message whose image
    parts come first) and the processed images."""
    if chat:
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs its template")
        prompts = [model.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}] * len(row) + [{"type": "text", "text": p}]}])
            if isinstance(p, str) else p for p, row in zip(prompts, images)]
    return multimodal.prepare(model, list(prompts), list(images), templated=chat)


def eos_ids(cfg, tokenizer) -> set[int]:
    """The ids that end a continuation: the config's EOS ids and the tokenizer's."""
    eos = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_id is not None:
        eos.add(tokenizer.eos_id)
    return eos


def _ids(what: str, seq, vocab: int) -> list[int]:
    """Token ids as Python ints, each in [0, vocab): the embedding gather would wrap or clamp any other."""
    if isinstance(seq, (str, bytes, bytearray)):  # iterating bytes gives ints: never read bytes as token ids
        raise ValueError(f"{what} is {type(seq).__name__}: pass a str or a list of token ids")
    if hasattr(seq, "dtype") and getattr(seq, "ndim", 0) == 1 and np.issubdtype(seq.dtype, np.integer):
        seq = np.asarray(seq).tolist()  # an integer array: no per-element checks needed
    try:
        seq = list(seq)
    except TypeError:
        raise ValueError(f"{what} must be a str or a list of token ids, got {type(seq).__name__}") from None
    if not seq:
        raise ValueError(f"{what} has no tokens")
    for t in seq:
        if not is_int(t):
            raise ValueError(f"{what}: token id {t!r} is not an int")
        if not 0 <= t < vocab:
            raise ValueError(f"{what}: token id {t} is outside the vocabulary [0, {vocab})")
    return [int(t) for t in seq]


def _prompt_ids(i: int, p, tok, chat: bool, vocab: int) -> list[int]:
    if isinstance(p, str):
        if tok is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        p = tok.encode_chat(p) if chat else tok.encode(p)
    return _ids(f"prompt {i}", p, vocab)


def _stops(stop, tok, vocab: int) -> list[tuple[str | None, list[int] | None]]:
    """Each stop sequence as (text or None, token ids to end on device or None).

    A bare string is one stop sequence (not its characters). A string's ids are its encoding without special
    tokens, used on device only when they decode back to it; the text is also cut on the host, since the model
    may spell it with other tokens.
    """
    if stop is None:
        return []
    seqs = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else None
    if seqs is None or any(is_int(s) for s in seqs):  # a flat id list is ambiguous: one sequence or several?
        raise ValueError(f"stop must be a string or a list of strings / token-id lists (e.g. [[5], [6, 7]]), "
                         f"got {stop!r}")
    out = []
    for j, s in enumerate(seqs):
        if not isinstance(s, str):
            out.append((None, _ids(f"stop {j}", s, vocab)))
            continue
        if not s:
            raise ValueError(f"stop {j} is an empty string: it would end every continuation at once")
        if tok is None:
            raise ValueError(f"stop {j} is a string but this model has no tokenizer: pass token ids")
        q = tok.encode(s, add_special_tokens=False)
        out.append((s, q if q and s in tok.decode(q, skip_special_tokens=False) else None))
    return out


def _cut(row: list[int], eos: set[int], stops, tok) -> list[int]:
    """Drop everything from the first EOS or stop sequence on."""
    end = next((i for i, t in enumerate(row) if t in eos), len(row))
    row = row[:end]
    cut = len(row)
    for s, q in stops:
        if q:
            cut = next((i for i in range(cut - len(q) + 1) if row[i: i + len(q)] == q), cut)
        if s is None or s not in tok.decode(row[:cut]):  # the common case: one decode, not one per token
            continue
        i = next(i for i in range(1, cut + 1) if s in tok.decode(row[:i]))
        start = tok.decode(row[:i]).find(s)  # the text holds s from token i - 1 on: cut before the first token
        cut = next(j for j in range(i - 1, -1, -1) if len(tok.decode(row[:j])) <= start)  # reaching into it
    return row[:cut]


def _cut_text(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    return text[:cut]
