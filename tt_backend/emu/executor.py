"""Runs TT programs on the NumPy emulator, against paged KV caches.

Executor API (what `tt_backend.generator` drives for vLLM-style prefill/decode):

    ex = Executor(model, numerics="full", policy="performance", max_seq_len=8192, block_size=32)
    kv = ex.allocate_kv_cache(num_blocks)        # [layer][0=K, 1=V] float32 [num_blocks, K, block, d]
    #   (or any buffers of ex.kv_cache_shape(num_blocks); layers may share one buffer pair)
    logits = ex.prefill(tokens, page_table_row, kv, owners=None)       # one user: [T, vocab]
    logits = ex.decode(tokens, positions, page_table, kv, owners=None)  # B <= 32 users: [B, vocab]

- prefill: `tokens` int [T] of one user; `page_table_row` int [W] holds that user's blocks in logical
  order. The prompt is padded to a multiple of 128; page-table entries past the prompt's own blocks
  are replaced by -1, so the padded tail never lands in a block the user does not own (#56324).
  Returns the logits of all T prompt positions. Multimodal prompts (`tt_backend.multimodal` makes both):
  `embeddings=` float [T, D] (the input embeddings with the image features spliced in) replaces the
  embedding lookup; `image_blocks=` int [T] (Gemma3: the bidirectional image region of each token, -1 for
  text) runs the prefill attention under `lowering.attention_masks` instead of the causal rule; `cross=` (a
  `cross_attention.CrossPrefill`: Mllama's image features, tile mask and cross page table) runs the cross-attention
  layers, which fill their K/V caches (without it they are skipped, as HF does without images).
- decode: `tokens` [B], `positions` [B] (absolute position of each token; -1 skips the row: no cache
  write, zero attention output), `page_table` [B, W] with W * block_size > max position. `cross=` (a
  `cross_attention.CrossDecode`) makes Mllama's cross layers read the K/V their prefills filled.
- caches are updated in place (device buffers), rounded to the policy's KV dtype (bfloat8_b by
  default) as the device would hold them. `owners` (a `paged_cache.RowOwners`) makes every cache write
  check block ownership and raise `paged_cache.BlockOwnershipError` on a foreign block.
- sliding-window layers use full-length caches; the window is applied when attention reads them.
- `run(program, inputs, kv)` executes any `TTProgram` and returns every named tensor it produced
  (per-layer outputs are "l<i>.out"), for layer-level tests.

For `tt_backend.generator` (vLLM contract), `VLLMExecutor` implements its `Executor` protocol:

    ex = VLLMExecutor(model, numerics="full", policy="performance", max_seq_len=..., block_size=32)
    logits = ex.prefill(tokens[1, S], chunk_start=, last_token_idx=, valid_seq_len=, page_tables=[per layer
                        [1, W]], chunk_page_tables=[per layer] | None, kv_cache=, cache_position_modulo=[per
                        layer int | None], owners=)                  # -> [vocab]
    logits = ex.decode(tokens[b], positions[b], page_tables=, kv_cache=, cache_position_modulo=, owners=)
    make = executor_factory(model, numerics="full")   # initialize_vllm_model(executor_factory=make)
    #   (DeepSeek models get `deepseek_emu.DeepSeekVLLMExecutor`: one page table and buffer per cache kind)

  - chunk_start > 0 (a later prefill chunk, or a cached prefix): the chunk is filled through its
    chunk_page_tables and attends to everything before it through the cache
    (`chunked_scaled_dot_product_attention`); chunk_start must be a multiple of block_size.
  - per-layer page tables that differ select a program whose layers read "page_table.<i>"; equal ones
    share one "page_table".
  - cache_position_modulo[i] = m turns layer i's cache into a ring of m tokens (fill stops at
    valid_seq_len; update and decode SDPA wrap positions mod m); not combined with chunked prefill.

Numerics: see `tt_backend.emu.numerics` (levels exact / storage / full).

Precision: a policy *name* ("performance", "accuracy") is resolved per model by `tt_backend.precision.for_model`
into a per-layer `DecodersPrecision` (bfp8 where bfp4 would break a layer, as measured on the weights); a
`Precision` or `DecodersPrecision` object is used exactly as given.
"""
from __future__ import annotations

import functools

import numpy as np

from tt_backend import cross_attention, paged_cache, precision
from tt_backend.deepseek_emu import DeepSeekVLLMExecutor
from tt_backend.deepseek_lowering import is_deepseek
from tt_backend.emu import numerics
from tt_backend.emu.ops import OPS, Env
from tt_backend.lowering import PREFILL_MULTIPLE, attention_masks, check_decode_batch, lower, padded_prefill_len
from tt_backend.program import Ref, TTProgram
from tt_backend.weights import policy as get_policy


class Executor:
    def __init__(self, model, *, numerics: str = "full", policy: str = "performance", max_seq_len: int = 8192,
                 block_size: int = 32):
        self.config, self.level = model.config, numerics_level(numerics)
        self.policy, self.max_seq_len, self.block_size = get_policy(policy), max_seq_len, block_size
        if isinstance(policy, str) and self.level != "exact":
            # a named policy is a starting point: tensors whose measured error breaks the layer are promoted
            # (tt_backend.precision); a Precision / DecodersPrecision object is used as given
            self.policy = precision.for_model(model, self.policy, executor=Executor)
        progs = lower(self.config, prefill_len=1, batch=1, max_seq_len=max_seq_len, block_size=block_size,
                      policy=self.policy, cross_tokens=int(cross_attention.is_cross(self.config)))
        # (checks the config and fixes the weight specs, the cross layers' too)
        specs = {n: s for n, s in progs.prefill.tensors.items() if s.kind == "weight"}
        specs |= {n: s for n, s in progs.decode.tensors.items() if s.kind == "weight"}
        host = cross_attention.prepare(self.config, model.params, max_seq_len)
        if set(host) != set(specs):
            raise ValueError(f"weights and program disagree: unused {sorted(set(host) - set(specs))}, "
                             f"missing {sorted(set(specs) - set(host))}")
        for n, s in specs.items():
            want = tuple(s.shape)
            if host[n].shape != want:
                raise ValueError(f"weight {n}: prepared shape {host[n].shape} != program shape {want}")
        self.weight_specs = specs  # what a device executor loads
        # weights are converted once on the host (ttnn.as_tensor): host packing at every level but exact
        self.weights = {n: self._store(v, specs[n].dtype, "host") for n, v in host.items()}
        self.kv_dtype = "ttnn.float32" if self.level == "exact" else self.policy.kv_cache

    # ------------------------------------------------------------------------------ programs
    @functools.lru_cache(maxsize=32)
    def program(self, mode: str, rows: int, chunk_start: int = 0, per_layer_page_tables: bool = False,
                cache_position_modulo: tuple | None = None, embeddings: bool = False,
                attention_mask: bool = False, cross_tokens: int = 0) -> TTProgram:
        """The prefill program for `rows` (padded) tokens (from input embeddings / under attention masks / with
        cross-attention over `cross_tokens` image features: see `lower`), or the decode program for `rows` users."""
        kw = dict(max_seq_len=self.max_seq_len, block_size=self.block_size, policy=self.policy,
                  per_layer_page_tables=per_layer_page_tables, cache_position_modulo=cache_position_modulo,
                  cross_tokens=cross_tokens)
        if mode == "prefill":
            return lower(self.config, prefill_len=rows, batch=1, chunk_start=chunk_start, embeddings=embeddings,
                         attention_mask=attention_mask, **kw).prefill
        return lower(self.config, prefill_len=1, batch=rows, **kw).decode

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return paged_cache.cache_shape(num_blocks, self.config.num_kv_heads, self.block_size, self.config.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> list[list[np.ndarray]]:
        shape = self.kv_cache_shape(num_blocks)
        return paged_cache.allocate_shared_buffers([(shape, np.float32, i) for i in range(self.config.num_layers)])

    # ----------------------------------------------------------------------------------- run
    def _store(self, x, dtype: str, mode: str):
        if self.level == "exact":
            return np.asarray(x, np.float32) if np.asarray(x).dtype.kind == "f" else x
        return numerics.quantize(x, dtype, "host" if self.level == "storage" else mode)

    def run(self, prog: TTProgram, inputs: dict, kv_cache, owners=None) -> dict[str, np.ndarray]:
        if set(inputs) != set(prog.inputs):
            raise ValueError(f"program inputs are {sorted(prog.inputs)}, got {sorted(inputs)}")
        if len(kv_cache) != self.config.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {self.config.num_layers}")
        t = dict(self.weights)
        t |= {n: np.asarray(v) for n, v in inputs.items()}
        for i, (k, v) in enumerate(kv_cache):
            t[f"kv.{i}.k"], t[f"kv.{i}.v"] = k, v
        env = Env(self.level, lambda x, dt: self._store(x, dt, "device"), self.kv_dtype, owners)
        for n, c in enumerate(prog.calls):
            fn = OPS.get(c.op)
            if fn is None:
                raise NotImplementedError(f"call {n}: the emulator has no {c.op}")
            kw = {k: t[v.name] if isinstance(v, Ref) else v for k, v in c.kwargs.items()}
            res = fn(env, *[t[x] for x in c.inputs], **kw)
            res = (res,) if len(c.outputs) == 1 else res
            for name, val in zip(c.outputs, res):
                t[name] = self._store(val, prog.tensors[name].dtype, "device")
        return t

    def prefill(self, tokens, page_table_row, kv_cache, *, owners=None, return_all: bool = False, embeddings=None,
                image_blocks=None, cross=None):
        """One user's prompt -> logits [T, vocab] (or every named tensor with return_all)."""
        tokens = np.asarray(tokens).reshape(-1)
        T = tokens.shape[0]
        S = padded_prefill_len(T)
        pt = paged_cache.prefill_page_table(page_table_row, T, S, self.block_size)
        t, prog = self._prefill(tokens, 0, [pt], None, None, T, kv_cache, owners, embeddings, image_blocks, cross)
        return t if return_all else _logits(t, prog)[:T]

    def _prefill(self, tokens, chunk_start, page_tables, chunk_page_tables, modulo, valid_len, kv_cache, owners,
                 embeddings=None, image_blocks=None, cross=None):
        prog, inputs = self.prefill_inputs(tokens, chunk_start, page_tables, chunk_page_tables, modulo, valid_len,
                                           embeddings, image_blocks, cross)
        return self.run(prog, inputs, kv_cache, owners), prog

    def prefill_inputs(self, tokens, chunk_start, page_tables, chunk_page_tables, modulo, valid_len,
                       embeddings=None, image_blocks=None, cross=None) -> tuple[TTProgram, dict]:
        """The prefill program for `tokens` [T] from `chunk_start` and its host inputs (any executor runs them)."""
        T = tokens.shape[0]
        S = padded_prefill_len(T)
        if chunk_start + S > self.max_seq_len:
            raise ValueError(f"prompt of {T} tokens from {chunk_start} pads to {chunk_start + S} > "
                             f"max_seq_len={self.max_seq_len}")
        per_layer = _per_layer(page_tables)
        inputs, Sx = {}, 0
        if cross is not None:
            if chunk_start:
                raise NotImplementedError("a prefill with image features runs whole prompts from position 0")
            if cross.tiles.shape[0] > S:
                raise ValueError(f"the cross-attention tile mask has {cross.tiles.shape[0]} rows for {T} tokens")
            Sx, cin = cross_attention.prefill_inputs(self.config, cross, S, self.block_size)
            inputs |= {n: x if "page_table" in n else self._store(x, "ttnn.bfloat16", "host") for n, x in cin.items()}
        prog = self.program("prefill", S, chunk_start, per_layer, modulo, embeddings is not None,
                            image_blocks is not None, cross_tokens=Sx)
        inputs["rope_pos"] = (chunk_start + np.arange(S, dtype=np.uint32))[None]
        if embeddings is None:
            ids = np.zeros((1, S), np.uint32)
            ids[0, :T] = tokens
            inputs["tokens"] = ids
        else:  # host -> device as the input's dtype (bf16), as ttnn.from_torch would
            emb = np.asarray(embeddings, np.float32)
            D = self.config.hidden_size
            if emb.shape[0] < T or emb.shape[1:] != (D,):
                raise ValueError(f"embeddings must be [{T}, {D}] (one row per prompt token), got {list(emb.shape)}")
            x = np.zeros((1, 1, S, D), np.float32)
            x[0, 0, :T] = emb[:T]
            inputs["embeddings"] = self._store(x, prog.tensors["embeddings"].dtype, "host")
        if image_blocks is not None:
            if chunk_start:
                raise NotImplementedError("a masked (image-block) prefill runs whole prompts from position 0")
            inputs |= {n: self._store(m, prog.tensors[n].dtype, "host")
                       for n, m in attention_masks(self.config, np.asarray(image_blocks)[:T], S).items()}
        inputs |= _tables("page_table", page_tables, per_layer, self.config.num_layers)
        if chunk_start:
            inputs |= _tables("chunk_page_table", chunk_page_tables, per_layer, self.config.num_layers)
        if "valid_seq_len" in prog.inputs:
            inputs["valid_seq_len"] = np.array([valid_len], np.int32)
        return prog, inputs

    def decode(self, tokens, positions, page_table, kv_cache, *, owners=None, return_all: bool = False,
               cache_position_modulo: tuple | None = None, cross=None):
        """One token per user -> logits [B, vocab]. `page_table`: [B, W], or a list with one per layer."""
        prog, inputs = self.decode_inputs(tokens, positions, page_table, cache_position_modulo, cross)
        t = self.run(prog, inputs, kv_cache, owners)
        return t if return_all else _logits(t, prog)

    def decode_inputs(self, tokens, positions, page_table, cache_position_modulo=None,
                      cross=None) -> tuple[TTProgram, dict]:
        """The decode program for len(tokens) users and its host inputs."""
        tokens, positions = np.asarray(tokens).reshape(-1), np.asarray(positions, np.int64).reshape(-1)
        B = tokens.shape[0]
        check_decode_batch(B)
        if positions.shape[0] != B:
            raise ValueError(f"{positions.shape[0]} positions for {B} tokens")
        if positions.max() >= self.max_seq_len:
            raise ValueError(f"position {positions.max()} >= max_seq_len={self.max_seq_len}")
        tables = list(page_table) if isinstance(page_table, (list, tuple)) else [page_table]
        per_layer = _per_layer(tables)
        inputs, Sx = {}, 0
        if cross is not None:
            Sx, cin = cross_attention.decode_inputs(self.config, cross, B, self.block_size)
            inputs |= {n: x if "page_table" in n else self._store(x, "ttnn.bfloat16", "host") for n, x in cin.items()}
        prog = self.program("decode", B, 0, per_layer, cache_position_modulo, cross_tokens=Sx)
        inputs |= {"tokens": tokens.astype(np.uint32)[None], "cur_pos": positions.astype(np.int32),
                   "rope_pos": np.maximum(positions, 0).astype(np.uint32)[None]}
        inputs |= _tables("page_table", tables, per_layer, self.config.num_layers)
        return prog, inputs


def _per_layer(tables) -> bool:
    """One page table for all layers unless the per-layer tables differ (hybrid KV-cache groups)."""
    return len(tables) > 1 and any(not np.array_equal(t, tables[0]) for t in tables[1:])


def _tables(name: str, tables, per_layer: bool, n_layers: int) -> dict:
    if per_layer:
        if len(tables) != n_layers:
            raise ValueError(f"{len(tables)} per-layer {name}s for {n_layers} layers")
        return {f"{name}.{i}": np.asarray(t, np.int32) for i, t in enumerate(tables)}
    return {name: np.asarray(tables[0], np.int32)}


class VLLMExecutor:
    """`tt_backend.generator.Executor` (the vLLM generator's per-submesh model) over the emulator.

    prefill: one user's (chunk of a) padded prompt [1, S] from `chunk_start`, written through per-layer
    page tables ([1, W]; `chunk_page_tables` for later chunks), `cache_position_modulo` per layer (sliding
    rings) -> float32 logits [vocab] of `last_token_idx`. decode: tokens/positions [b] -> logits [b, vocab].
    """

    def __init__(self, model, *, numerics: str = "full", policy: str = "performance", max_seq_len: int = 8192,
                 block_size: int = 32):
        self.executor = Executor(model, numerics=numerics, policy=policy, max_seq_len=max_seq_len,
                                 block_size=block_size)
        self.config = model.config

    @classmethod
    def wrap(cls, executor: Executor) -> "VLLMExecutor":
        """Over an emulator already built (its weights, numerics, policy and limits)."""
        self = cls.__new__(cls)
        self.executor, self.config = executor, executor.config
        return self

    @staticmethod
    def _modulo(cache_position_modulo):
        m = tuple(cache_position_modulo or ())
        return m if any(x for x in m) else None

    def prefill(self, tokens, *, chunk_start, last_token_idx, valid_seq_len, page_tables, chunk_page_tables,
                kv_cache, cache_position_modulo, owners, embeddings=None, image_blocks=None, cross=None):
        tokens = np.asarray(tokens).reshape(-1)
        t, prog = self.executor._prefill(tokens, int(chunk_start), list(page_tables),
                                         None if chunk_page_tables is None else list(chunk_page_tables),
                                         self._modulo(cache_position_modulo), int(valid_seq_len), kv_cache, owners,
                                         embeddings, image_blocks, cross)
        return _logits(t, prog)[int(last_token_idx)]

    def decode(self, tokens, positions, *, page_tables, kv_cache, cache_position_modulo, owners, cross=None):
        return self.executor.decode(tokens, positions, list(page_tables), kv_cache, owners=owners,
                                    cache_position_modulo=self._modulo(cache_position_modulo), cross=cross)


def executor_factory(model, *, numerics: str = "full", policy: str | None = None, block_size: int = 32):
    """For `tt_backend.generator.initialize_vllm_model(executor_factory=...)`: (config, submesh,
    max_batch_size, max_seq_len, optimizations) -> VLLMExecutor over `model`'s params; `optimizations`
    ("performance" / "accuracy") picks the precision policy unless `policy` is given."""

    def make(config, submesh, max_batch_size, max_seq_len, optimizations="performance"):
        check_decode_batch(max_batch_size)
        pol = policy or (optimizations if isinstance(optimizations, str) else "performance")
        # a prefill continuing a cached prefix pads up to 127 tokens past max_seq_len (whole 128-row programs)
        room = -(-(max_seq_len + PREFILL_MULTIPLE - 1) // block_size) * block_size
        cls = DeepSeekVLLMExecutor if is_deepseek(config) else VLLMExecutor  # mHC + MLA: its own lowering and caches
        return cls(first_layers(model, config), numerics=numerics, policy=pol, max_seq_len=room, block_size=block_size)

    return make


def first_layers(model, config):
    """`model` cut to `config` when config is model.config with only its first n layers (vLLM's n_layers)."""
    import dataclasses

    from jaxmodels.plan import plan

    if config == model.config:
        return model
    n = config.num_layers
    if dataclasses.replace(model.config, layers=model.config.layers[:n]) != config:
        raise ValueError("the generator's config is neither the model's nor its first layers")
    layers = {str(k): _head(model.params["layers"][str(k)], c) for k, c in enumerate(plan(config).counts)}
    return dataclasses.replace(model, config=config, params={**model.params, "layers": layers})


def _head(tree, n):
    return {k: _head(v, n) for k, v in tree.items()} if isinstance(tree, dict) else tree[:n]


def _logits(t: dict, prog: TTProgram) -> np.ndarray:
    x = t[prog.outputs[0]]
    return np.asarray(x, np.float32).reshape(-1, x.shape[-1])


def numerics_level(level: str) -> str:
    return numerics.check_level(level)


def forward(model, tokens, numerics: str = "full", policy: str = "performance") -> np.ndarray:
    """tokens int [B, T] -> float32 logits [B, T, vocab]: each row prefilled by the emulated TT program
    (the counterpart of `jm.forward`)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    B, T = tokens.shape
    bs = 32
    S = padded_prefill_len(T)
    ex = Executor(model, numerics=numerics, policy=policy, max_seq_len=S, block_size=bs)
    out = np.empty((B, T, model.config.logits_size), np.float32)
    for b in range(B):
        kv = ex.allocate_kv_cache(S // bs)
        out[b] = ex.prefill(tokens[b], np.arange(S // bs, dtype=np.int32), kv)
    return out
