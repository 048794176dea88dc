"""The vLLM-facing contract of Tenstorrent's ``models/tt_transformers/tt/generator_vllm.py``, executor-agnostic.

Names and argument lists follow tenstorrent/tt-metal's ``generator_vllm.py`` / ``generator.py`` and the
vllm-tt-plugin decode reload contract (``docs/DECODE_RELOAD_CONTRACT.md``):

* ``initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers=None,
  tt_data_parallel=1, optimizations="performance")`` builds one model replica per data-parallel submesh,
  each with ``max_batch_size // tt_data_parallel`` users.
* ``allocate_kv_cache(kv_cache_shape, dtype, num_layers)`` / ``allocate_kv_cache_per_layer(per_layer_specs)``
  return ``[submesh][layer][k|v]`` buffers; layers with one ``tensor_idx`` share one buffer.
* ``get_kv_cache_spec(vllm_config)`` (hybrid models) names layers ``model.layers.<i>.self_attn``.
* ``prefill_forward(tokens, page_table, kv_cache, prompt_lens, empty_slots, ..., start_pos, page_tables_per_layer)``
  -> logits ``[batch, 1, vocab]``; ``decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace,
  read_from_device, sampling_params, reload_inputs, reload_page_table, reload_sampling_params,
  reset_sampling_state, prompt_tokens, output_tokens, slot_remap, page_tables_per_layer)``.
* ``model_capabilities``, ``decode_input_update_contract = 1``, ``get_max_tokens_all_users``.

What runs a forward pass is an `Executor` (one per submesh, all sharing one set of weights). The default,
``tt_backend.VLLMExecutor``, runs the NumPy emulation of the lowered TT program with everything the generator
hands it: per-layer page tables, sliding rings (``cache_position_modulo``), chunked prefill and prefill from a
cached prefix (``start_pos``). `TTNNDeviceExecutor` runs the same programs on a Tenstorrent device through
``tt_backend.ttnn_exec``; tests also use a JAX reference. Executors read and write the paged caches through
`tt_backend.paged_cache`; the generator owns page-table construction, chunking, DP splitting, reload commands
and trace bookkeeping.

Cache specs are derived per cache kind (`kv_cache_specs`, from what the lowering declares): full attention,
sliding windows (rings with hybrid groups) and DeepSeek's window rings, compressed CSA/HCA entries, indexer keys
and compressor state; `kv_cache_groups` groups equal specs as vLLM's hybrid allocator does.
Cache buffers are host NumPy arrays (float32 unless a NumPy dtype is asked for); the emulator rounds what it
writes to its precision policy's KV dtype (bfloat8_b by default), as the device would store it.

Multimodal prefill (Gemma3, Mistral3, EXAONE 4.5 images; `tt_backend.multimodal`): ``prefill_forward(...,
images=)`` (per user: None, raw images, or processed inputs such as a BatchFeature; or ``pixel_values=`` /
``image_sizes=`` per user, as tt-metal's Gemma3 passes them) runs the vision tower **in JAX on the host** and hands
the prompt's input embeddings to the TT text prefill (its "embeddings" input); Gemma3's image soft tokens attend
to each other through prefill attention masks. ``input_processor`` expands a prompt's image placeholders as the HF
processor does. Mllama's tower runs in JAX too, but its features enter the lowered cross-attention layers, which
compute their K/V on the device once per request into the cross layers' paged caches (``cross_page_table``) and
read them at every decode step (`MllamaForConditionalGeneration`, `tt_backend.cross_attention`). Images for a
model without a tower are refused; ``model_capabilities`` of the ``*ForConditionalGeneration`` classes say where
the tower runs.

Not done (raise rather than run something else): non-greedy device sampling and penalties
(``prompt_tokens``/``output_tokens`` are accepted and unused), prefill traces, hidden-state returns,
asynchronous readback (``read_from_device=False`` returns a handle that `read_decode_output` resolves, but
nothing overlaps), images with a cached prefix or in a chunked prefill, and prefix caching or chunked
prefill into sliding rings (the lowering refuses it, as tt-metal; with ``hybrid_kv_cache_groups=False``, the
default, sliding layers keep full-length caches and both work).

DeepSeek V4 / V4.1 (`DeepseekV4ForCausalLM`) run through the same ``prefill_forward`` / ``decode_forward``, over
its hybrid caches by kind: every cache of `kv_cache_specs` (per layer a window ring; on kv sources compressed
CSA / HCA entries, indexer keys, compressor state) has its own buffer and page table, passed by name
(``page_tables_per_layer={name: table}``); the default executor is `deepseek_emu.DeepSeekVLLMExecutor`. Prompts
prefill in chunks and continue from a prefix already in the caches (``start_pos``; the blocks a request may share
are `DeepseekV4ForCausalLM.prefix_blocks`), but vLLM's prefix caching is not advertised (the window ring and partly
filled entry blocks would need copies). The generator keeps each slot's last tokens for Engram's host-side n-gram
hashes (moved by ``slot_remap`` with the other slot state).

Deliberate differences from tt-metal (each guards a silent-corruption path it has):
* A user's prefill page table holds only the blocks that cover its prompt; the padded tail's entries
  are -1, so ``paged_fill_cache`` skips it (tt-metal hands the fill the vLLM row up to the padded length:
  #56324). ``prefill_page_table_mode = "tt"`` reproduces tt-metal for tests of the ownership check.
* With ``hybrid_kv_cache_groups=True`` sliding layers get a ring of ``sliding_ring_capacity`` tokens
  addressed with ``cache_position_modulo`` (tt-metal keeps that path disabled and gives sliding layers
  full-length caches; that is our default too).
* Batches that do not split evenly over the data-parallel submeshes raise instead of ``torch.chunk``'s
  uneven split.
* Only greedy sampling runs "on device" (argmax written back into the resident token buffer); other
  sampling parameters raise. ``model_capabilities`` says so (no ``supports_sample_on_device``).
* Mllama follows HF (the parity reference), not Meta's reference / tt-metal: a text row that sees no image tile
  keeps its cross-attention output (only its MLP update is zeroed). Its prefill returns the logits only; the
  tiles each slot's decode rows see are kept by the generator instead of being handed back through vLLM.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Hashable, Protocol, Sequence

import numpy as np

from jaxmodels.config import ModelConfig
from jaxmodels.plan import model_state_specs
from tt_backend import deepseek_lowering, paged_cache as pc
from tt_backend.deepseek_emu import paged_caches
from tt_backend.emu.executor import VLLMExecutor, executor_factory as emulator_factory
from tt_backend.lowering import padded_prefill_len
from tt_backend.weights import policy as get_policy

FALLBACK_MAX_TOKENS_ALL_USERS = 131_072  # tt-metal's ModelCapabilitiesMixin fallback
MIN_PREFILL_CHUNK = 128  # chunked SDPA / prefill lengths are multiples of 128


class TraceReplayError(ValueError):
    """A traced decode was replayed with inputs whose shapes or buffers differ from the capture."""


class ReloadContractError(ValueError):
    """An illegal or unexecutable combination of decode reload commands."""


# ------------------------------------------------------------------------------------ executor
class Executor(Protocol):
    """One model replica (one data-parallel submesh) running forward passes over paged caches.

    ``page_tables`` / ``kv_cache`` / ``cache_position_modulo`` are per cache: per layer, or (DeepSeek) per
    `kv_cache_specs` entry, in `Generator.cache_names` order (caches sharing a ``tensor_idx`` get the same buffer
    objects). Ownership checks, when given, apply to every cache write. A model with Engram also gets
    ``history`` in decode: int [b, max_ngram-1], each row's previous token ids (-1 where none).
    """

    config: ModelConfig

    def prefill(self, tokens: np.ndarray, *, chunk_start: int, last_token_idx: int, valid_seq_len: int,
                page_tables: Sequence[np.ndarray], chunk_page_tables: Sequence[np.ndarray] | None,
                kv_cache: Sequence[Sequence[np.ndarray]], cache_position_modulo: Sequence[int | None],
                owners: pc.RowOwners | None) -> np.ndarray:
        """One user's (chunk of a) padded prompt ``[1, S]`` starting at position `chunk_start`; writes its K/V
        through ``page_tables`` (``[1, W]`` per layer; ``chunk_page_tables`` is the chunk's slice) and returns the
        float32 logits ``[vocab]`` of token `last_token_idx` (relative to the chunk). ``valid_seq_len`` real tokens.

        Multimodal prompts add two keywords (only then; text-only calls never pass them): ``embeddings``
        float32 ``[S, D]``, the chunk's input embeddings to start from instead of the token lookup, and
        ``image_blocks`` int ``[S]`` (Gemma3, whole prompts only): each token's bidirectional image region
        (-1: text), for the prefill attention masks."""

    def decode(self, tokens: np.ndarray, positions: np.ndarray, *, page_tables: Sequence[np.ndarray],
               kv_cache: Sequence[Sequence[np.ndarray]], cache_position_modulo: Sequence[int | None],
               owners: pc.RowOwners | None) -> np.ndarray:
        """One token per user (``tokens``/``positions`` ``[b]``; position -1: inactive row) -> logits ``[b, vocab]``."""


# ----------------------------------------------------------------------------- cache specs
# What each cache *is* (vLLM's kv_cache_interface): one spec per cache, named as vLLM names attention layers.
# `tensors`: 2 for separate K and V, 1 for one latent cache read as both (MLA) or for keys only (indexer keys).
_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "bfloat8_b": 1088 / 1024, "bfloat4_b": 576 / 1024}


def _dtype_bytes(dtype) -> float:
    name = str(dtype).split(".")[-1]
    if name not in _DTYPE_BYTES:
        raise ValueError(f"cache dtype {dtype!r}: bytes per element unknown (known: {sorted(_DTYPE_BYTES)})")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class AttentionSpec:
    """A paged cache: ``block_size`` tokens a block, ``num_kv_heads`` x ``head_size`` per entry."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    tensors: int = 2

    @property
    def page_size_bytes(self) -> int:
        return int(self.tensors * self.block_size * self.num_kv_heads * self.head_size * _dtype_bytes(self.dtype))


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """vLLM's ``FullAttentionSpec``: every token's K/V."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """vLLM's ``SlidingWindowSpec``: only the last ``sliding_window`` tokens are read (served as a ring)."""

    sliding_window: int = 0

    def __post_init__(self):
        if self.sliding_window <= 0:
            raise ValueError(f"SlidingWindowSpec needs a positive sliding_window, got {self.sliding_window}")


@dataclass(frozen=True)
class CompressedSpec(AttentionSpec):
    """One entry per ``compress_ratio`` tokens (DeepSeek): ``kind`` "csa" (compressed KV an indexer selects
    from), "hca" (compressed KV attended whole) or "index_keys" (the indexer's keys of those entries)."""

    compress_ratio: int = 1
    kind: str = "csa"

    def __post_init__(self):
        if self.kind not in ("csa", "hca", "index_keys") or self.compress_ratio < 1:
            raise ValueError(f"CompressedSpec: kind {self.kind!r} (csa / hca / index_keys), "
                             f"ratio {self.compress_ratio}")


@dataclass(frozen=True)
class CompressorStateSpec(AttentionSpec):
    """Per-token rows a gated compressor reads back (DeepSeek: the projections "a" or gates "g" of the group
    being pooled, fp32): paged like a token cache; ``of`` names the cache it feeds (csa / hca / index_keys)."""

    of: str = "csa"


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """vLLM's ``CrossAttentionSpec``: the K/V of a request's encoder (image-feature) tokens, written once by its
    prefill through its cross page table and read by every decode step (Mllama's cross-attention layers)."""


_CACHE_SUFFIX = {"full": "", "window": "", "csa": ".compressor", "hca": ".compressor", "index_keys": ".indexer"}


def cache_kinds(cfg: ModelConfig, block_size: int, policy="performance") -> list[dict]:
    """Every cache of every layer as the lowering declares it (layer, kind, width, tokens_per_entry, dtype, ring;
    DeepSeek's `deepseek_lowering.kv_specs`, which names each cache's program tensor in "cache"); GQA layers:
    "full" or "window", K and V of num_kv_heads x head_dim; Mllama's cross layers "cross" (image-feature K/V)."""
    if deepseek_lowering.is_deepseek(cfg):
        return deepseek_lowering.kv_specs(cfg, block_size, get_policy(policy))
    kind = lambda a: "cross" if a.kind == "cross" else "full" if a.window is None else "window"  # noqa: E731
    return [{"layer": i, "kind": kind(s.attention), "ring": s.attention.window,
             "heads": cfg.num_kv_heads, "width": cfg.head_dim, "tokens_per_entry": 1, "tensors": 2}
            for i, s in enumerate(cfg.layers)]


def kv_cache_specs(cfg: ModelConfig, block_size: int, dtype, *, hybrid: bool = True) -> dict[str, Any]:
    """``{name: spec}`` for every cache, by kind: "model.layers.<i>.self_attn" (full, or window: a
    `SlidingWindowSpec` when `hybrid`, else full-length as tt-metal), ".compressor" (csa / hca), ".indexer"
    (index_keys), "<that>.state.<a|g>" (a gated compressor's per-token projections / gates) and
    "model.layers.<i>.cross_attn" (Mllama's image-feature K/V, a `CrossAttentionSpec`). A DeepSeek reuse
    layer has no compressed cache of its own: it reads its source layer's. `dtype`: the token and compressed
    caches' (vLLM's); compressor state keeps the lowering's (fp32). Heads: 1 unless declared (DeepSeek's latent
    K = V and indexer keys are single-head, `tensors` 1)."""
    specs, owner = {}, {}
    for c in cache_kinds(cfg, block_size):
        i, kind = c["layer"], c["kind"]
        base = f"model.layers.{i}.self_attn"
        if kind == "reuse":
            continue
        if kind not in ("compressor_state", "cross") and kind not in _CACHE_SUFFIX:
            raise NotImplementedError(f"layer {i}: cache kind {kind!r} has no generator spec")
        common = dict(block_size=block_size, num_kv_heads=c.get("heads", 1), head_size=c["width"], dtype=dtype,
                      tensors=c.get("tensors", 1))
        if kind == "compressor_state":
            spec = CompressorStateSpec(**{**common, "dtype": c["dtype"]}, of=c["of"])
            name = f"{base}{_CACHE_SUFFIX[c['of']]}.state.{c['cache'].split('.')[-1]}"
        elif kind == "cross":
            spec, name = CrossAttentionSpec(**common), f"model.layers.{i}.cross_attn"
        elif kind in ("full", "window") and not (hybrid and kind == "window"):
            spec, name = FullAttentionSpec(**common), base
        elif kind == "window":
            spec, name = SlidingWindowSpec(**common, sliding_window=c["ring"]), base
        else:
            spec = CompressedSpec(**common, compress_ratio=c["tokens_per_entry"], kind=kind)
            name = base + _CACHE_SUFFIX[kind]
        if name in owner:
            raise ValueError(f"{name}: declared twice ({owner[name]} and {kind})")
        specs[name], owner[name] = spec, kind
    return specs


def kv_cache_groups(specs: dict[str, Any]) -> list[tuple[Any, list[str]]]:
    """Caches with equal specs form one group (vLLM's hybrid KV-cache groups: one page size, one table per
    group); in first-seen order. Derived, never configured by hand."""
    groups: dict[Any, list[str]] = {}
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return list(groups.items())


def sliding_ring_capacity(window: int, block_size: int) -> int:
    """Tokens in a sliding layer's ring: vLLM's ``cdiv(window - 1, block_size) + 1`` blocks.

    The extra block is needed, not just tidy: the ring prefill (``valid_seq_len``) rounds the prompt up to a
    whole block, so up to ``block_size - 1`` padding tokens land in the ring after the last real one, and a
    ring of exactly ``window`` tokens would lose the oldest in-window positions to them.
    """
    return (-(-(window - 1) // block_size) + 1) * block_size


def get_padded_prefill_len(seq_len: int) -> int:
    """The padded length of a prefill: the lowering's rule (`lowering.padded_prefill_len`, the next multiple of
    128), so the generator chunks exactly the programs the lowering builds. (tt_transformers pads further, to the
    smaller of the next power of two and the next multiple of 1024, to reuse fewer prefill traces.)"""
    return padded_prefill_len(seq_len)


def get_max_prefill_chunk_size(seq_len: int, max_prefill_chunk_size: int) -> int:
    """The largest multiple of 128 that is <= the limit and divides `seq_len` (seq_len itself if it fits)."""
    if seq_len <= max_prefill_chunk_size:
        return seq_len
    if seq_len % MIN_PREFILL_CHUNK or max_prefill_chunk_size < MIN_PREFILL_CHUNK:
        raise ValueError(f"chunked prefill needs seq_len ({seq_len}) and the chunk limit "
                         f"({max_prefill_chunk_size}) to be multiples of {MIN_PREFILL_CHUNK}")
    for size in range(max_prefill_chunk_size - max_prefill_chunk_size % MIN_PREFILL_CHUNK, 0, -MIN_PREFILL_CHUNK):
        if seq_len % size == 0:
            return size
    raise AssertionError("unreachable: 128 divides seq_len")


# ---------------------------------------------------------------------------- submeshes
@dataclass(frozen=True)
class EmulatedMesh:
    """A stand-in for a ttnn mesh device: just its shape (no device is opened)."""

    shape: tuple[int, int] = (1, 1)

    def get_num_devices(self) -> int:
        return self.shape[0] * self.shape[1]


def create_submeshes(mesh_device: EmulatedMesh, data_parallel: int) -> list[EmulatedMesh]:
    """Split a mesh into `data_parallel` equal submeshes (as tt-metal's ``create_submeshes``)."""
    n = mesh_device.get_num_devices()
    if data_parallel <= 0 or n % data_parallel:
        raise ValueError(f"cannot split a mesh of {n} devices into {data_parallel} data-parallel submeshes")
    if data_parallel == 1:
        return [mesh_device]
    rows, cols = mesh_device.shape
    per = n // data_parallel
    shape = (1, per) if rows == 1 or per < cols or per % cols else (per // cols, cols)
    return [EmulatedMesh(shape) for _ in range(data_parallel)]


def _hf_dict(hf_config) -> dict:
    if isinstance(hf_config, dict):
        return hf_config
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return dict(vars(hf_config))


def _text_config(hf: dict) -> dict:
    tc = hf.get("text_config")
    return _hf_dict(tc) if tc is not None else hf


def _model_config(hf_config, n_layers: int | None) -> ModelConfig:
    if isinstance(hf_config, ModelConfig):
        cfg = hf_config
    else:
        from jaxmodels import families

        cfg = families.config_from_hf(_hf_dict(hf_config))
    if n_layers is not None:
        if not 0 < n_layers <= cfg.num_layers:
            raise ValueError(f"n_layers={n_layers} outside 1..{cfg.num_layers}")
        cfg = dataclasses.replace(cfg, layers=cfg.layers[:n_layers])
    return cfg


@dataclass
class _Trace:
    shapes: dict[str, tuple]  # input name -> (shape, dtype)
    buffers: tuple[int, ...]  # ids of the kv buffers the trace reads


@dataclass
class _Resident:
    """Persistent decode inputs of one submesh (what a captured trace reads at fixed addresses)."""

    tokens: np.ndarray
    positions: np.ndarray
    page_tables: list[np.ndarray]
    device_sampled: bool = False  # the last decode wrote its argmax into `tokens` and advanced `positions`
    cross_page_table: np.ndarray | None = None  # Mllama: each slot's blocks of its image-feature K/V


class _DeviceOutput:
    """A decode result not yet read back (``read_from_device=False``)."""

    def __init__(self, parts: list[np.ndarray], batch: int, is_tokens: bool):
        self.parts, self.batch, self.is_tokens = parts, batch, is_tokens


# ---------------------------------------------------------------------------------- generator
class Generator:
    """Data-parallel replicas over paged KV caches; the vLLM entry points live here and in subclasses."""

    decode_input_update_contract = 1
    # vLLM reads this off the class. No supports_async_decode / supports_sample_on_device: only greedy argmax
    # runs "on device".
    model_capabilities: dict = {"supports_prefix_caching": True}
    _HYBRID_KV_CACHE_GROUPS_ENABLED = False
    serves_deepseek = False  # DeepseekV4ForCausalLM: page tables and buffers per cache kind, not per layer
    prefill_page_table_mode = "safe"  # "tt": tt-metal's per-user page table (pad tail through the vLLM row)

    def __init__(self, executors: Sequence[Executor], mesh_device: EmulatedMesh | None = None, *,
                 max_batch_size: int, max_seq_len: int, block_size: int | None = None,
                 max_prefill_chunk_size: int = 4096, hybrid_kv_cache_groups: bool | None = None, vision=None,
                 max_images_per_prompt: int = 1):
        if not executors:
            raise ValueError("need at least one executor (one per data-parallel submesh)")
        self.model = list(executors)
        self.config = self.model[0].config
        self.mesh_device = mesh_device
        self.data_parallel = len(self.model)
        if max_batch_size % self.data_parallel:
            raise ValueError(f"max_batch_size={max_batch_size} does not split over {self.data_parallel} submeshes")
        self.max_batch_size = max_batch_size
        self.max_batch_size_per_model = max_batch_size // self.data_parallel
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.max_prefill_chunk_size = max_prefill_chunk_size
        self.hybrid_kv_cache_groups = (self._HYBRID_KV_CACHE_GROUPS_ENABLED if hybrid_kv_cache_groups is None
                                       else hybrid_kv_cache_groups)
        self.vision = vision  # tt_backend.multimodal.VisionTower (the host half of multimodal prefill) or None
        # Mllama: images per request whose K/V the cross layers keep (tt-metal serves 1); the tiles each slot's decode
        # rows see (its prompt's last cross_attention_mask row), kept from its prefill; None: a slot without images
        self.max_images_per_prompt = max_images_per_prompt
        self._cross_rows: list[np.ndarray | None] = [None] * max_batch_size
        self._resident: list[_Resident | None] = [None] * self.data_parallel
        self._trace: _Trace | None = None
        if deepseek_lowering.is_deepseek(self.config) != self.serves_deepseek:
            raise ValueError(f"{type(self).__name__} cannot serve this {self.config.family} model: DeepSeek V4 / V4.1 "
                             "(caches per kind) are served by DeepseekV4ForCausalLM, other models by their own class")
        # per slot: the token ids of its last positions that host-side inputs need (Engram's n-grams), -1 where none
        n = sum(st.shape[0] for st in model_state_specs(self.config) if st.name == "engram_history")
        self._history = np.full((max_batch_size, n), -1, np.int32)
        self._owners: tuple[Sequence[pc.BlockAllocator], Sequence[Hashable | None]] | None = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len, n_layers=None,
                              tt_data_parallel=1, optimizations: str | None = "performance", *,
                              executor_factory=None, model=None, numerics: str = "full", block_size: int = 32,
                              **kwargs):
        """One executor per data-parallel submesh, each for ``max_batch_size // tt_data_parallel`` users.

        By default each submesh runs the NumPy emulator of the lowered TT program (``tt_backend.VLLMExecutor``)
        on `model` (a ``jaxmodels.Model``, cut to its first `n_layers`; loaded from ``hf_config["_name_or_path"]``
        when not given), at `numerics` and the precision policy `optimizations`. executor_factory(config, submesh,
        max_batch_size, max_seq_len, optimizations) -> Executor replaces it (tests, other backends).
        A `model` with a vision tower (given, or loaded) also gives the generator its host-side tower
        (`tt_backend.multimodal.VisionTower`) for multimodal prefill.
        """
        if max_batch_size % tt_data_parallel:
            raise ValueError(f"max_batch_size={max_batch_size} does not split over tt_data_parallel={tt_data_parallel}")
        if executor_factory is None:
            if model is None:
                path = _hf_dict(hf_config).get("_name_or_path") if not isinstance(hf_config, ModelConfig) else None
                if not path:
                    raise ValueError("initialize_vllm_model needs model= (a jaxmodels.Model), a checkpoint in "
                                     "hf_config['_name_or_path'], or executor_factory")
                import jaxmodels as jm

                model = jm.load(path)
            executor_factory = emulator_factory(model, numerics=numerics, block_size=block_size)
            cfg = _model_config(model.config, n_layers)
        else:
            cfg = _model_config(hf_config, n_layers)
        mesh = mesh_device if isinstance(mesh_device, EmulatedMesh) else EmulatedMesh((1, int(mesh_device or 1)))
        submeshes = create_submeshes(mesh, tt_data_parallel)
        per = max_batch_size // tt_data_parallel
        executors = [executor_factory(cfg, s, per, max_seq_len, optimizations) for s in submeshes]
        if model is not None and model.config.vision is not None:
            from tt_backend.multimodal import VisionTower

            kwargs.setdefault("vision", VisionTower(model))
        return cls(executors, mesh, max_batch_size=max_batch_size, max_seq_len=max_seq_len, block_size=block_size,
                   **kwargs)

    @property
    def cache_path(self):
        return None  # nothing is cached on disk by the emulated backend

    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 **kwargs) -> int:
        """All-user KV-cache token capacity; subclasses know device/model-specific budgets."""
        return FALLBACK_MAX_TOKENS_ALL_USERS

    # ---- KV cache -----------------------------------------------------------------------------
    def allocate_kv_cache(self, kv_cache_shape, dtype, num_layers):
        """Uniform caches, one buffer per layer: ``allocate_kv_cache_per_layer`` with ``tensor_idx = layer``."""
        return self.allocate_kv_cache_per_layer([(kv_cache_shape, dtype, i) for i in range(num_layers)])

    def allocate_kv_cache_per_layer(self, per_layer_specs):
        """``[submesh][layer][k|v]`` zero buffers ``[num_blocks, kv_heads, block_size, head_dim]``, one pair per
        tensor_idx (sharers get the same arrays)."""
        if len(per_layer_specs) != self.config.num_layers:
            raise ValueError(f"{len(per_layer_specs)} per-layer specs for a model of {self.config.num_layers} layers")
        for layer, (shape, _, _) in enumerate(per_layer_specs):
            want = (self.config.num_kv_heads, self.config.head_dim)
            if (shape[1], shape[3]) != want:
                raise ValueError(f"layer {layer}: kv_cache_shape {tuple(shape)} must have kv_heads, head_dim = {want}")
            if self.block_size is None:
                self.block_size = int(shape[2])
            elif shape[2] != self.block_size:
                raise ValueError(f"layer {layer}: block_size {shape[2]} differs from the generator's {self.block_size}")
        return [pc.allocate_shared_buffers([(s, _np_dtype(d), t) for s, d, t in per_layer_specs])
                for _ in range(self.data_parallel)]

    @classmethod
    def get_kv_cache_spec(cls, vllm_config, *, hybrid_kv_cache_groups: bool | None = None):
        """`kv_cache_specs` of the model vLLM serves (``model_config.hf_config``, through ``families``).

        As in tt-metal, a sliding layer gets a `FullAttentionSpec` unless hybrid kv-cache groups are enabled; then
        a `SlidingWindowSpec` (served as a ring through ``cache_position_modulo``). DeepSeek's caches are hybrid
        by nature (window rings, compressed CSA/HCA entries, indexer keys, compressor state) and always declared
        so: the upstream plugin keeps hybrid groups disabled, so it cannot serve them.
        """
        from jaxmodels import families

        hybrid = cls._HYBRID_KV_CACHE_GROUPS_ENABLED if hybrid_kv_cache_groups is None else hybrid_kv_cache_groups
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        hf = _hf_dict(mc.hf_config)
        cfg = families.config_from_hf(hf if "model_type" in hf else _text_config(hf))
        hybrid = hybrid or deepseek_lowering.is_deepseek(cfg)
        return kv_cache_specs(cfg, cc.block_size, getattr(mc, "dtype", "bfloat16"), hybrid=hybrid)

    def cache_position_modulo(self) -> list[int | None]:
        """Per layer: the ring capacity of sliding layers when hybrid groups are on, else None."""
        if not self.hybrid_kv_cache_groups:
            return [None] * self.config.num_layers
        if self.block_size is None:
            raise ValueError("allocate the KV cache first: the ring capacity depends on its block size")
        return [None if s.attention.window is None else sliding_ring_capacity(s.attention.window, self.block_size)
                for s in self.config.layers]

    def cache_names(self) -> list[str]:
        """The caches kv_cache lists and page tables follow, by their `kv_cache_specs` names: one per layer."""
        return list(kv_cache_specs(self.config, self.block_size or 32, "bfloat16"))

    def tokens_per_entry(self) -> list[int]:
        """Per cache (`cache_names` order): tokens per cache row; 1 for token caches."""
        return [1] * self.config.num_layers

    def _cache_label(self, i: int) -> str:
        return f"layer {i}"

    def _cross_caches(self) -> set[int]:
        """The caches of cross-attention layers (written by prefill only, through ``cross_page_table``)."""
        return {i for i, s in enumerate(self.config.layers) if s.attention.kind == "cross"}

    # ---- ownership (emulator only) --------------------------------------------------------------
    def track_block_ownership(self, allocators: Sequence[pc.BlockAllocator],
                              request_of_slot: Sequence[Hashable | None]) -> None:
        """Check every cache write against `allocators` (one per submesh); `request_of_slot` maps global slots
        to requests and is read at each call, so the caller may update it in place."""
        if len(allocators) != self.data_parallel:
            raise ValueError(f"{len(allocators)} allocators for {self.data_parallel} submeshes")
        self._owners = (list(allocators), request_of_slot)

    def _row_owners(self, model_id: int, slots: Sequence[int]) -> pc.RowOwners | None:
        if self._owners is None:
            return None
        allocators, request_of_slot = self._owners
        return pc.RowOwners(allocators[model_id], [request_of_slot[s] for s in slots])

    # ---- page tables --------------------------------------------------------------------------
    def _page_tables_per_layer(self, page_table, page_tables_per_layer) -> list[np.ndarray]:
        n = self.config.num_layers
        if page_tables_per_layer is not None:
            if len(page_tables_per_layer) != n:
                raise ValueError(f"page_tables_per_layer has {len(page_tables_per_layer)} entries for {n} layers")
            if any(pt is None for pt in page_tables_per_layer):
                raise ValueError("page_tables_per_layer has a None entry; every layer needs its table")
            return [np.asarray(pt, np.int32) for pt in page_tables_per_layer]
        if page_table is None:
            raise ValueError("a paged forward needs page_table or page_tables_per_layer")
        if self.hybrid_kv_cache_groups and any(m for m in self.cache_position_modulo()):
            raise ValueError("with hybrid kv-cache groups the sliding layers need their own tables: "
                             "pass page_tables_per_layer")
        return [np.asarray(page_table, np.int32)] * n

    def _check_kv(self, kv_cache) -> None:
        if kv_cache is None or len(kv_cache) != self.data_parallel:
            raise ValueError(f"kv_cache must hold one per-layer list per submesh ({self.data_parallel})")
        for i, layers in enumerate(kv_cache):
            if len(layers) != self.config.num_layers:
                raise ValueError(f"kv_cache[{i}] has {len(layers)} layers, the model {self.config.num_layers}")

    # ---- prefill ------------------------------------------------------------------------------
    def prefill_forward(self, tokens, page_table=None, kv_cache=None, prompt_lens=None, empty_slots=None,
                        enable_trace=True, model_id_warmup=None, sampling_params=None, start_pos=None,
                        return_hidden_states=False, warmup_prefill=True, page_tables_per_layer=None, images=None,
                        pixel_values=None, image_sizes=None, cross_page_table=None, **kwargs):
        """Prefill each user of ``tokens [batch, seq]`` into its slot; returns float32 logits ``[batch, 1, vocab]``.

        start_pos: per-user lengths already in the cache (prefix caching); multiples of the block size.
        Prefill is not traced here; ``enable_trace`` and the warmup flags are accepted for signature
        compatibility. ``return_hidden_states`` and device sampling in prefill are not supported.

        images: one entry per user (None: text only), see `VisionTower.images_of`: raw images, or the processed
        inputs (a mapping / BatchFeature with ``pixel_values`` [, ``image_sizes``, ``token_type_ids``]);
        pixel_values / image_sizes: per-user lists of the processed arrays instead (tt-metal's Gemma3 path). The
        prompt must hold its images' tokens (`input_processor`). The tower runs in JAX on the host and the TT
        prefill starts from the resulting input embeddings.

        Mllama (`MllamaForConditionalGeneration`): images per user as tt-metal passes them (an image, a list, or the
        processed inputs); the tower's image features enter the TT prefill, whose cross-attention layers compute
        and keep their K/V in the cross layers' caches through ``cross_page_table`` [batch, W] (each row: that
        user's blocks for its `cross_attn_tokens` image-feature tokens). A row without images skips them.
        """
        if "reset_batch" in kwargs:
            raise TypeError("reset_batch is a pre-contract keyword; decode_input_update_contract 1 does not accept it")
        if return_hidden_states:
            raise NotImplementedError("prefill_forward(return_hidden_states=True) is not supported")
        if sampling_params is not None:
            raise NotImplementedError("device sampling in prefill is not supported; sample the returned logits")
        if kwargs:
            raise TypeError(f"unexpected prefill_forward arguments: {sorted(kwargs)}")
        self._check_kv(kv_cache)
        tokens = np.asarray(tokens)
        B, T = tokens.shape
        user_images = self._user_images(B, images, pixel_values, image_sizes)
        crossing = any(s.attention.kind == "cross" for s in self.config.layers)
        if cross_page_table is not None and not crossing:
            raise ValueError(f"cross_page_table is for cross-attention layers; this {self.config.family} model has "
                             "none")
        prompt_lens = [T] * B if prompt_lens is None else [int(n) for n in np.asarray(prompt_lens).reshape(-1)]
        empty_slots = list(range(B)) if empty_slots is None else [int(s) for s in empty_slots]
        cached = [0] * B if start_pos is None else [int(n) for n in np.asarray(start_pos).reshape(-1)]
        if not len(prompt_lens) == len(empty_slots) == len(cached) == B:
            raise ValueError(f"prompt_lens, empty_slots and start_pos must have one entry per row ({B})")
        tables = self._page_tables_per_layer(page_table, page_tables_per_layer)
        bs = self._require_block_size()
        modulo = self.cache_position_modulo()
        vocab = self.config.logits_size
        for r in self._resident:  # the first decode after a prefill is a transition: inputs must be reloaded
            if r is not None:
                r.device_sampled = False
        out = np.zeros((B, 1, vocab), np.float32)
        for idx, slot in enumerate(empty_slots):
            if not 0 <= slot < self.max_batch_size:
                raise ValueError(f"slot {slot} outside 0..{self.max_batch_size - 1}")
            seq_len, n_cached = prompt_lens[idx], cached[idx]
            if not 0 <= n_cached < seq_len <= min(T, self.max_seq_len):
                raise ValueError(f"row {idx}: need 0 <= start_pos ({n_cached}) < prompt_len ({seq_len}) <= "
                                 f"min(tokens, max_seq_len) = {min(T, self.max_seq_len)}")
            if n_cached % bs:
                raise ValueError(f"row {idx}: start_pos {n_cached} is not a multiple of the block size {bs}")
            if n_cached and any(modulo) and not self.serves_deepseek:  # DeepSeek's executor continues its rings
                raise NotImplementedError("prefix caching / chunk continuation is not supported with sliding rings")
            model_id = slot // self.max_batch_size_per_model
            embeddings = blocks = cross = None
            if user_images[idx] is not None:
                if n_cached:
                    raise NotImplementedError(f"row {idx}: images with a cached prefix (start_pos={n_cached}): "
                                              "the image features are spliced into the whole prompt")
                if crossing:
                    cross = self._cross_prefill(idx, tokens[idx, :seq_len], user_images[idx], cross_page_table)
                else:
                    embeddings, blocks = self.vision.prefill_inputs(tokens[idx, :seq_len], user_images[idx])
            out[idx, 0] = self._prefill_user(
                tokens[idx, n_cached:seq_len], n_cached, seq_len, [pt[idx] for pt in tables], modulo,
                kv_cache[model_id], model_id, self._row_owners(model_id, [slot]), embeddings, blocks, cross,
                tokens[idx, :n_cached])
            if crossing:  # what this slot's decode rows see; a request without images clears the last one's
                self._cross_rows[slot] = None if cross is None else cross.tiles[-1].copy()
            self._remember(slot, tokens[idx, :seq_len])
        return out

    def _remember(self, slot: int, tokens) -> None:
        """Keep the last tokens of slot's sequence that the next decode step's host inputs need."""
        n = self._history.shape[1]
        if n:
            tail = np.asarray(tokens, np.int32)[-n:]
            self._history[slot] = -1
            self._history[slot, n - len(tail):] = tail

    @property
    def max_cross_attn_tokens(self) -> int:
        """Image-feature tokens a request's cross K/V may hold (tt-metal's name): cross_page_table rows need
        ceil(cross_attn_tokens(images) / block_size) blocks."""
        return self.cross_attn_tokens(self.max_images_per_prompt)

    def cross_attn_tokens(self, num_images: int) -> int:
        """Mllama: the image-feature tokens of `num_images` images (each max_tiles tiles, pad tiles included)."""
        from tt_backend import cross_attention

        return cross_attention.cross_tokens(self.config, num_images)

    def _cross_prefill(self, idx: int, tokens, entry, cross_page_table):
        """Row idx's Mllama images -> its `cross_attention.CrossPrefill` (features from the JAX tower)."""
        from tt_backend.cross_attention import CrossPrefill

        if cross_page_table is None:
            raise ValueError("Mllama images need cross_page_table: per row, the blocks of its image-feature K/V in "
                             "the cross layers' caches")
        table = np.asarray(cross_page_table)
        if table.ndim != 2 or table.shape[0] <= idx:
            raise ValueError(f"cross_page_table must be [batch, blocks] with a row per user, got {list(table.shape)}")
        try:
            states, tiles = self._tower().cross_inputs(tokens, entry, self.max_images_per_prompt)
        except ValueError as e:
            raise ValueError(f"row {idx}: {e}") from None
        return CrossPrefill(states, tiles, table[idx])

    def input_processor(self, prompt, images=None) -> tuple[list[int], dict | None]:
        """vLLM's multimodal input processor: (prompt token ids with each image placeholder expanded into the
        image's tokens, the processed images for ``prefill_forward(images=[...])``), as the family's HF processor
        makes them; without images the prompt is only tokenized (ids pass through)."""
        if not images:
            if isinstance(prompt, str):
                tok = self.vision.model.tokenizer if self.vision is not None else None
                if tok is None:
                    raise ValueError("no tokenizer to encode a text prompt: pass token ids")
                return tok.encode(prompt), None
            return [int(t) for t in prompt], None
        return self._tower().process_prompt(prompt, list(images))

    def _tower(self):
        """The host-side vision tower, or the reason there is none."""
        v = self.config.vision
        if v is None:
            raise ValueError(f"this {self.config.family} model has no vision tower: it takes no images")
        if self.vision is None:
            raise ValueError("images need the vision tower's weights: build the generator with "
                             "initialize_vllm_model(model=...) or pass vision=tt_backend.multimodal.VisionTower(model)")
        return self.vision

    def _user_images(self, batch: int, images, pixel_values, image_sizes) -> list[dict | None]:
        """Per user: the processed images (HF names) or None, from ``images`` or ``pixel_values``/``image_sizes``."""
        if images is not None and (pixel_values is not None or image_sizes is not None):
            raise ValueError("pass images or pixel_values/image_sizes, not both")
        if images is None and pixel_values is None:
            if image_sizes is not None:
                raise ValueError("image_sizes without pixel_values")
            return [None] * batch
        name, per_user = ("images", images) if images is not None else ("pixel_values", pixel_values)
        if isinstance(per_user, np.ndarray) or not isinstance(per_user, (list, tuple)) or len(per_user) != batch:
            got = f"{len(per_user)} entries" if isinstance(per_user, (list, tuple)) else type(per_user).__name__
            raise ValueError(f"{name} must be a list with one entry (or None) per user ({batch}), got {got}")
        if image_sizes is not None and len(image_sizes) != batch:
            raise ValueError(f"image_sizes must be a list with one entry per user ({batch}), got {len(image_sizes)}")
        if all(e is None or isinstance(e, (list, tuple)) and not e for e in per_user):
            return [None] * batch
        tower = self._tower()
        if self.config.vision.kind == "mllama":  # raw or processed, per user: VisionTower.cross_inputs reads them
            if images is None:
                raise ValueError("Mllama takes images= (per user: images, or the processor's pixel_values with "
                                 "aspect_ratio_ids and aspect_ratio_mask), not pixel_values= alone")
            return [None if e is None or isinstance(e, (list, tuple)) and not e else e for e in per_user]
        if images is None:  # tt-metal's Gemma3 path: per-user pixel_values (and Mistral3's image_sizes)
            per_user = [None if pv is None else {"pixel_values": np.asarray(pv)} | (
                {} if image_sizes is None or image_sizes[i] is None else {"image_sizes": np.asarray(image_sizes[i])})
                for i, pv in enumerate(per_user)]
        return [tower.images_of(e) for e in per_user]

    def prefill_forward_text(self, *args, **kwargs):
        return self.prefill_forward(*args, **kwargs)

    def _require_block_size(self) -> int:
        if self.block_size is None:
            raise ValueError("block size unknown: allocate the KV cache (or pass block_size) first")
        return self.block_size

    def _prefill_user(self, new_tokens, n_cached, seq_len, rows, modulo, kv, model_id, owners, embeddings=None,
                      blocks=None, cross=None, prefix=()):
        bs = self.block_size
        n_new = seq_len - n_cached
        padded = get_padded_prefill_len(n_new)
        ids = np.zeros((1, padded), np.int32)
        ids[0, :n_new] = new_tokens
        image = {}  # the multimodal keywords, padded like the prompt
        if embeddings is not None:
            image["embeddings"] = np.zeros((padded, embeddings.shape[1]), np.float32)
            image["embeddings"][:n_new] = embeddings
        if blocks is not None:
            image["image_blocks"] = np.full(padded, -1, np.int32)
            image["image_blocks"][:n_new] = blocks
        user_tables = []
        for row, m, r in zip(rows, modulo, self.tokens_per_entry()):
            if m:  # a sliding ring: the whole ring row; the fill wraps and stops at the real length
                if row.shape[0] < m // bs:
                    raise ValueError(f"a ring of {m} tokens needs {m // bs} page-table columns, got {row.shape[0]}")
                user_tables.append(np.asarray(row[None, : m // bs], np.int32))
            elif self.prefill_page_table_mode == "tt":
                user_tables.append(pc.raw_prefill_page_table(row, -(-(n_cached + padded) // r), bs))
            else:  # entry caches (r tokens a row): the prompt's complete entries; the padded rows' entries
                user_tables.append(pc.prefill_page_table(row, seq_len // r, -(-(n_cached + padded) // r), bs))
        # the blocks this prefill may write: a ring's all; otherwise from the first row past the cached prefix
        firsts = [0 if m else n_cached // r // bs for m, r in zip(modulo, self.tokens_per_entry())]
        written = [set(t[0, a:][t[0, a:] >= 0].tolist()) for t, a in zip(user_tables, firsts)]
        for layer in self._cross_caches():  # writes its image K/V through the cross table, or nothing
            own = np.asarray(cross.page_table)[:-(-cross.states.shape[0] // bs)] if cross is not None else []
            written[layer] = {int(x) for x in own if x >= 0}
        _check_shared_writes(kv, dict(enumerate(written)))
        if cross is not None:
            image["cross"] = cross
        chunk = get_max_prefill_chunk_size(padded, self.max_prefill_chunk_size)
        if chunk < padded and any(modulo) and not self.serves_deepseek:
            raise NotImplementedError("chunked prefill is not supported with sliding rings (as in tt-metal)")
        if chunk < padded and cross is not None:
            raise NotImplementedError(f"a prompt with Mllama images pads to {padded} tokens > the prefill chunk "
                                      f"{self.max_prefill_chunk_size}: its cross layers fill their K/V in one prefill")
        if chunk < padded and blocks is not None:
            raise NotImplementedError(f"a prompt with Gemma3 images pads to {padded} tokens > the prefill chunk "
                                      f"{self.max_prefill_chunk_size}: chunked prefill has no attention mask for "
                                      "the bidirectional image blocks")
        last = n_new - 1
        context = np.concatenate([np.asarray(prefix, np.int64).reshape(-1), np.asarray(ids[0, :n_new], np.int64)])
        for start in range(0, padded, chunk):
            if self._history.shape[1] and n_cached + start:  # Engram hashes a chunk's tokens with those before it
                image["history"] = context[max(0, n_cached + start - self._history.shape[1]):n_cached + start]
            end = start + chunk
            a, b = (n_cached + start) // bs, -(-(n_cached + end) // bs)
            chunk_tables = None if chunk == padded and not n_cached else [t[:, a:b] for t in user_tables]
            logits = self.model[model_id].prefill(
                ids[:, start:end], chunk_start=n_cached + start, last_token_idx=min(last, end - 1) - start,
                valid_seq_len=max(0, min(n_new, end) - start), page_tables=user_tables,
                chunk_page_tables=chunk_tables, kv_cache=kv, cache_position_modulo=modulo, owners=owners,
                **{k: v if k in ("cross", "history") else v[start:end] for k, v in image.items()})
            if start <= last < end:  # later chunks would hold only padding
                return logits
        raise AssertionError("unreachable: the last token lies in some chunk")

    # ---- decode -------------------------------------------------------------------------------
    def decode_forward(self, tokens, start_pos, page_table=None, kv_cache=None, enable_trace=True,
                       read_from_device=True, sampling_params=None, reload_inputs=True, reload_page_table=False,
                       reload_sampling_params=False, reset_sampling_state=False, prompt_tokens=None,
                       output_tokens=None, slot_remap=None, page_tables_per_layer=None, cross_page_table=None,
                       **kwargs):
        """One decode step for every slot. Returns logits ``[batch, 1, vocab]`` (host sampling) or the greedy
        tokens ``[batch]`` (``sampling_params`` with temperature 0, sampled "on device").

        Mllama: ``cross_page_table`` [batch, W] (reloaded with the page tables) addresses the image K/V each slot's
        prefill kept; which tiles a slot's rows see is kept by the generator from that prefill (tt-metal hands
        the masks back to vLLM, which passes them to every decode). Slots without images add nothing there.

        Reload commands (contract v1): ``reload_inputs`` copies tokens, positions and page tables into the
        persistent inputs; ``reload_page_table`` copies only page tables and is illegal together with it;
        with neither, the resident token/position left by the previous greedy device decode are used.
        ``reset_sampling_state`` requires ``reload_inputs``. ``slot_remap[new] = old`` is applied once to the
        resident per-slot state before the step reads it. With ``enable_trace`` the first call captures the
        persistent inputs' shapes and cache buffers; later calls must match them exactly.
        """
        if "reset_batch" in kwargs:
            raise TypeError("reset_batch is a pre-contract keyword; decode_input_update_contract 1 does not accept it")
        if kwargs:
            raise TypeError(f"unexpected decode_forward arguments: {sorted(kwargs)}")
        if cross_page_table is not None and not any(s.attention.kind == "cross" for s in self.config.layers):
            raise ValueError(f"cross_page_table is for cross-attention layers; this {self.config.family} model has "
                             "none")
        if reload_inputs and reload_page_table:
            raise ReloadContractError("reload_page_table is only valid without reload_inputs "
                                      "(a full input reload already copies the page tables)")
        if reset_sampling_state and not reload_inputs:
            raise ReloadContractError("reset_sampling_state requires reload_inputs")
        greedy = self._greedy(sampling_params)
        if (reload_sampling_params or reset_sampling_state) and not greedy:
            raise ReloadContractError("reload_sampling_params/reset_sampling_state=True but no device sampling "
                                      "is active (sampling_params is None)")
        self._check_kv(kv_cache)
        bs = self._require_block_size()
        modulo = self.cache_position_modulo()
        dp = self.data_parallel

        if reload_inputs:
            tok = np.asarray(tokens).reshape(-1).astype(np.int32)
            pos = np.asarray(start_pos).reshape(-1).astype(np.int32)
            if tok.shape != pos.shape:
                raise ValueError(f"tokens {tok.shape} and start_pos {pos.shape} must both be [batch]")
            tok_parts, pos_parts = pc.chunk_batch(tok, dp), pc.chunk_batch(pos, dp)
        if reload_inputs or reload_page_table:
            tables = self._page_tables_per_layer(page_table, page_tables_per_layer)
            table_parts = [pc.chunk_batch(t, dp) for t in tables]  # [layer][submesh]
            cross_parts = ([None] * dp if cross_page_table is None else
                           pc.chunk_batch(np.asarray(cross_page_table, np.int32), dp))
        if not reload_inputs and any(r is None or not r.device_sampled for r in self._resident):
            raise ReloadContractError("reload_inputs=False but no resident decode inputs are valid: the previous "
                                      "decode did not sample on device, a prefill came in between, or there "
                                      "was no decode yet")
        if slot_remap is not None:
            self._apply_slot_remap(slot_remap)

        # copy host inputs into the persistent buffers; a captured trace pins their shapes and the caches
        if enable_trace and self._trace is not None:
            staged = {}
            for i in range(dp):
                if reload_inputs:
                    staged[f"submesh{i}.tokens"] = tok_parts[i]
                    staged[f"submesh{i}.start_pos"] = pos_parts[i]
                if reload_inputs or reload_page_table:
                    for layer, t in enumerate(table_parts):
                        staged[f"submesh{i}.page_table[{layer}]"] = t[i]
                    if cross_parts[i] is not None:
                        staged[f"submesh{i}.cross_page_table"] = cross_parts[i]
            self._check_replay(staged, kv_cache)
        for i in range(dp):
            if reload_inputs:
                self._resident[i] = _Resident(tok_parts[i].copy(), pos_parts[i].copy(),
                                              [t[i].copy() for t in table_parts])
            elif reload_page_table:
                self._resident[i].page_tables = [t[i].copy() for t in table_parts]
            if reload_inputs or reload_page_table:
                self._resident[i].cross_page_table = None if cross_parts[i] is None else cross_parts[i].copy()
        per = self.tokens_per_entry()  # the row a position writes: position // per (a ring: position % m)
        for r in self._resident:  # before a trace captures what cannot run
            top = int(r.positions.max(initial=-1))
            if top >= self.max_seq_len:
                raise ValueError(f"decode position {top} >= max_seq_len={self.max_seq_len}")
            for layer, (t, m, n) in enumerate(zip(r.page_tables, modulo, per)):
                if (m and t.shape[1] * bs < m) or (not m and top // n // bs >= t.shape[1]):
                    raise ValueError(f"{self._cache_label(layer)}: a page table of {t.shape[1]} blocks of {bs} "
                                     f"cannot address {f'a ring of {m}' if m else f'position {top}'}")
        if enable_trace and self._trace is None:
            self._trace = self._trace_signature(kv_cache)  # capture

        parts = []
        for i in range(dp):
            r = self._resident[i]
            writes = {}
            for layer, (t, m, n) in enumerate(zip(r.page_tables, modulo, per)):
                if layer in self._cross_caches():
                    continue  # a cross layer writes nothing in decode
                q = np.where(r.positions >= 0, r.positions % m if m else r.positions // n, -1)
                rows = np.flatnonzero((q >= 0) & (q // bs < t.shape[1]))
                blocks = t[rows, q[rows] // bs]
                writes[layer] = {int(b) for b in blocks if b >= 0}
            _check_shared_writes(kv_cache[i], writes)
            slots = range(i * self.max_batch_size_per_model, i * self.max_batch_size_per_model + len(r.tokens))
            fed, active = r.tokens.copy(), r.positions >= 0
            history = {"history": self._history[list(slots)].copy()} if self._history.shape[1] else {}
            logits = np.asarray(self.model[i].decode(
                r.tokens.copy(), r.positions.copy(), page_tables=r.page_tables, kv_cache=kv_cache[i],
                cache_position_modulo=modulo, owners=self._row_owners(i, list(slots)),
                **self._cross_decode(r, slots), **history), np.float32)
            for slot, tok in zip(np.asarray(slots)[active], fed[active]):
                self._remember(slot, [*self._history[slot], tok])
            if greedy:
                nxt = np.argmax(logits, axis=-1).astype(np.int32)
                r.tokens[active] = nxt[active]  # token feedback into the persistent input
                r.positions[active] += 1  # one position advance per decode
                r.device_sampled = True
                parts.append(nxt)
            else:
                r.device_sampled = False
                parts.append(logits[:, None, :])
        out = _DeviceOutput(parts, sum(len(p) for p in parts), greedy)
        return self.read_decode_output(out) if read_from_device else out

    def _cross_decode(self, r: _Resident, slots) -> dict:
        """The `cross` keyword of a submesh's decode: only when one of its slots holds images (Mllama)."""
        tiles = [self._cross_rows[s] for s in slots]
        if all(t is None for t in tiles):
            return {}
        if r.cross_page_table is None:
            raise ValueError("slots that were prefilled with images decode through their kept image K/V: pass "
                             "cross_page_table (as in their prefill)")
        from tt_backend.cross_attention import CrossDecode

        return {"cross": CrossDecode(tiles, r.cross_page_table, self.max_cross_attn_tokens)}

    def read_decode_output(self, output: _DeviceOutput, async_read: bool = False):
        """Host copy of a decode result (tokens ``[batch]`` or logits ``[batch, 1, vocab]``)."""
        return np.concatenate(output.parts, axis=0)

    def release_trace(self) -> None:
        """Forget the captured decode trace; the next traced decode captures again."""
        self._trace = None

    # ---- decode helpers -----------------------------------------------------------------------
    @staticmethod
    def _greedy(sampling_params) -> bool:
        if sampling_params is None:
            return False
        temps = np.asarray(getattr(sampling_params, "temperature", sampling_params), np.float64).reshape(-1)
        if (temps != 0).any():
            raise NotImplementedError("only greedy (temperature 0) device sampling is emulated; sample the "
                                      "logits on the host (sampling_params=None)")
        return True

    def _trace_signature(self, kv_cache) -> _Trace:
        shapes = {}
        for i, r in enumerate(self._resident):
            shapes[f"submesh{i}.tokens"] = (r.tokens.shape, r.tokens.dtype)
            shapes[f"submesh{i}.start_pos"] = (r.positions.shape, r.positions.dtype)
            for layer, t in enumerate(r.page_tables):
                shapes[f"submesh{i}.page_table[{layer}]"] = (t.shape, t.dtype)
            if r.cross_page_table is not None:
                shapes[f"submesh{i}.cross_page_table"] = (r.cross_page_table.shape, r.cross_page_table.dtype)
        bufs = tuple(id(a) for sub in kv_cache for layer in sub for a in layer)
        return _Trace(shapes, bufs)

    def _check_replay(self, staged: dict[str, np.ndarray], kv_cache) -> None:
        """Before any copy: the staged host inputs must fit the captured persistent buffers exactly."""
        for name, x in staged.items():
            want, have = self._trace.shapes.get(name), (x.shape, x.dtype)
            if want != have:
                raise TraceReplayError(f"decode trace captured {name} as shape {want[0] if want else None}, "
                                       f"replayed with {x.shape}: batch and page-table shapes must not change "
                                       "between capture and replay (release_trace() to capture again)")
        bufs = tuple(id(a) for sub in kv_cache for layer in sub for a in layer)
        if bufs != self._trace.buffers:
            raise TraceReplayError("decode trace replayed with different KV-cache buffers than it captured "
                                   "(a trace reads fixed addresses); call release_trace() first")

    def _apply_slot_remap(self, slot_remap) -> None:
        """``slot_remap[new] = old`` in global slots; each submesh's slice must stay inside that submesh."""
        remap = [int(s) for s in np.asarray(slot_remap).reshape(-1)]
        if len(remap) % self.data_parallel:
            raise ValueError(f"slot_remap has {len(remap)} entries, not divisible over {self.data_parallel} submeshes")
        stride = len(remap) // self.data_parallel
        if sorted(remap) != list(range(len(remap))):
            raise ValueError(f"slot_remap must be a permutation of 0..{len(remap) - 1}, got {remap}")
        for i, r in enumerate(self._resident):
            local = [old - i * stride for old in remap[i * stride:(i + 1) * stride]]
            if any(not 0 <= o < stride for o in local):
                raise ValueError(f"slot_remap moves a request across data-parallel submesh {i}")
            base = i * self.max_batch_size_per_model  # Mllama: what each slot's rows see moves with the slot
            self._cross_rows[base:base + stride] = [self._cross_rows[base + o] for o in local]
            self._history[base:base + stride] = self._history[[base + o for o in local]]
            if r is None:
                continue
            if len(r.tokens) != stride:
                raise ValueError(f"slot_remap covers {stride} slots per submesh, the resident batch {len(r.tokens)}")
            r.tokens[...] = r.tokens[local]
            r.positions[...] = r.positions[local]


def _check_shared_writes(kv_layers, writes: dict[int, set[int]]) -> None:
    """Layers sharing one buffer (one tensor_idx) must write disjoint blocks: writes = {layer: {block}}.

    Without this, two sharers given the same page table overwrite each other's K/V (or read each other's
    rows as their own) and no ownership check notices: the request owns the block for both layers.
    """
    groups: dict[int, list[int]] = {}
    for layer, pair in enumerate(kv_layers):
        groups.setdefault(id(pair[0]), []).append(layer)
    for layers in groups.values():
        seen: dict[int, int] = {}
        for layer in layers:
            for blk in writes.get(layer, ()):
                if seen.setdefault(blk, layer) != layer:
                    raise pc.PagedCacheError(
                        f"layers {seen[blk]} and {layer} share a KV buffer (one tensor_idx) and both write block "
                        f"{blk}: the sharers' page tables must map disjoint blocks")


def _np_dtype(dtype):
    """Host storage for a requested cache dtype: NumPy dtypes pass through; TT/torch names store float32."""
    if dtype is None:
        return np.float32
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.float32


# ------------------------------------------------------------------------- executors
def EmulatorExecutor(emu) -> VLLMExecutor:  # noqa: N802 (the older class name, kept for callers)
    """The default executor over an emulator already built: ``VLLMExecutor.wrap(emu)``."""
    return VLLMExecutor.wrap(emu)


class TTNNDeviceExecutor:
    """`Executor` on a Tenstorrent device: the programs and host inputs the emulator builds (`programs`, a
    ``tt_backend.Executor`` whose policy and limits they follow), run by `device` (a
    ``tt_backend.ttnn_exec.TTNNExecutor``). Weights are loaded once. Each host KV buffer the generator
    allocated names one device cache of its shape, zeroed on first use and kept on the device (the host arrays
    are not updated). Block ownership is not checked on the device; the generator's shared-block check runs."""

    def __init__(self, programs, device, params):
        from tt_backend.cross_attention import prepare  # weights.prepare, plus Mllama's cross layers

        self.programs, self.device, self.config = programs, device, programs.config
        host = prepare(self.config, params, programs.max_seq_len)
        self.weights = device.load(host, programs.weight_specs)
        self._caches: dict[int, tuple[np.ndarray, Any]] = {}  # id(host buffer) -> (buffer, device tensor)

    def _run(self, prog, inputs: dict, kv_cache) -> np.ndarray:
        tensors = dict(self.weights)
        for i, pair in enumerate(kv_cache):
            for host, kv in zip(pair, "kv"):
                name = f"kv.{i}.{kv}"
                if id(host) not in self._caches:  # keep `host` alive so its id is not reused
                    self._caches[id(host)] = (host, self.device.to_device(np.zeros(host.shape, np.float32),
                                                                          prog.tensors[name], name))
                tensors[name] = self._caches[id(host)][1]
        for name, x in inputs.items():  # page tables to the program's width: -1 past the generator's columns
            want = prog.tensors[name].shape
            if "page_table" in name and x.shape[1] != want[1]:
                x = np.pad(x, ((0, 0), (0, max(0, want[1] - x.shape[1]))), constant_values=pc.SKIP)[:, :want[1]]
            inputs[name] = x
        out = self.device.run(prog, inputs, tensors)[prog.outputs[0]]
        x = self.device.to_numpy(out)
        return np.asarray(x, np.float32).reshape(-1, x.shape[-1])

    def prefill(self, tokens, *, chunk_start, last_token_idx, valid_seq_len, page_tables, chunk_page_tables,
                kv_cache, cache_position_modulo, owners, embeddings=None, image_blocks=None, cross=None):
        modulo = VLLMExecutor._modulo(cache_position_modulo)
        prog, inputs = self.programs.prefill_inputs(
            np.asarray(tokens).reshape(-1), int(chunk_start), list(page_tables),
            None if chunk_page_tables is None else list(chunk_page_tables), modulo, int(valid_seq_len),
            embeddings, image_blocks, cross)
        return self._run(prog, inputs, kv_cache)[int(last_token_idx)]

    def decode(self, tokens, positions, *, page_tables, kv_cache, cache_position_modulo, owners, cross=None):
        prog, inputs = self.programs.decode_inputs(tokens, positions, list(page_tables),
                                                   VLLMExecutor._modulo(cache_position_modulo), cross)
        return self._run(prog, inputs, kv_cache)[:len(tokens)]


# --------------------------------------------------------------------------- model classes
class HybridAttentionForCausalLM(Generator):
    """Mixed sliding/full attention (Gemma3, EXAONE 4.5, GPT-OSS): per-layer page tables, sliding rings with
    ``hybrid_kv_cache_groups=True``. Prefix caching is not advertised (as tt-metal): a ring cannot be continued
    from a cached prefix. Without rings (the default) ``start_pos`` still works through the generator."""

    model_capabilities = {"supports_prefix_caching": False}


class LlamaForCausalLM(Generator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 is_wormhole: bool = True, **kwargs) -> int:
        if "Llama-3.1-8B" in model_name and num_devices // tt_data_parallel == 1 and is_wormhole:
            return 32_768  # one Wormhole (N150)
        return super().get_max_tokens_all_users(model_name, num_devices, tt_data_parallel, **kwargs)


class QwenForCausalLM(Generator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 is_wormhole: bool = True, **kwargs) -> int:
        per = num_devices // tt_data_parallel
        if "Qwen3-8B" in model_name and per == 1 and is_wormhole:
            return 32_768
        if ("DeepSeek-R1-Distill-Qwen-14B" in model_name or "Qwen2.5-14B" in model_name) and per == 2 and is_wormhole:
            return 65_536
        return super().get_max_tokens_all_users(model_name, num_devices, tt_data_parallel, **kwargs)


class MistralForCausalLM(Generator):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 is_wormhole: bool = True, **kwargs) -> int:
        if "Mistral-7B" in model_name and num_devices // tt_data_parallel == 1 and is_wormhole:
            return 65_536
        return super().get_max_tokens_all_users(model_name, num_devices, tt_data_parallel, **kwargs)


class CohereForCausalLM(Generator):
    pass


class Gemma3ForCausalLM(HybridAttentionForCausalLM):
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 is_wormhole: bool = True, **kwargs) -> int:
        if "gemma-3-4b" in model_name.lower() and num_devices // tt_data_parallel in (1, 2) and is_wormhole:
            return 65_536
        return super().get_max_tokens_all_users(model_name, num_devices, tt_data_parallel, **kwargs)


class Exaone4ForCausalLM(HybridAttentionForCausalLM):
    pass


# ------------------------------------------------------------------------------- multimodal
# What the *ForConditionalGeneration classes tell vLLM about images (tt_backend.multimodal):
# vision_tower "jax": the tower runs in JAX on the host and its embeddings enter the TT text prefill (not ttnn calls);
# Mllama's image features enter its lowered cross-attention layers instead ("image_inputs": "cross_attention").
_VISION_IN_JAX = {"supports_multimodal": True, "vision_tower": "jax", "image_inputs": "embeddings"}


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma3 with images: SigLIP tower in JAX; each image's soft tokens attend to each other in the TT prefill
    (bidirectional blocks as attention-mask inputs, so such prompts prefill in one chunk).

    ``prefill_forward(tokens=..., page_table=..., kv_cache=..., prompt_lens=..., images=[per user])`` or
    ``pixel_values=[per user]`` (tt-metal's Gemma3 passes the processed inputs' ``pixel_values``)."""

    model_capabilities = {"supports_prefix_caching": False, **_VISION_IN_JAX, "image_attention": "bidirectional"}


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """Mistral3 with images: the Pixtral tower and patch merger in JAX; a causal text prefill from the embeddings.

    ``prefill_forward(tokens, images, page_table, kv_cache, prompt_lens, cross_page_table)`` is tt-metal's order;
    Mistral3 has no cross-attention, so ``cross_page_table`` is accepted and unused."""

    model_capabilities = {"supports_prefix_caching": False, **_VISION_IN_JAX, "image_attention": "causal"}

    def prefill_forward(self, tokens, images=None, page_table=None, kv_cache=None, prompt_lens=None,
                        cross_page_table=None, **kwargs):
        return super().prefill_forward(tokens, page_table, kv_cache, prompt_lens, images=images, **kwargs)


class MllamaForConditionalGeneration(Generator):
    """Llama 3.2 Vision. The tiled vision tower and projector run in JAX on the host; the image features enter the
    TT prefill, whose lowered cross-attention layers project them to K/V (each layer its own wk / wv / k_norm),
    keep them in the cross layers' paged caches through ``cross_page_table`` and read them in every decode step
    (not recomputed). A request without images skips the cross layers, as HF does (each request on its own: HF's
    batched rule, where a text row next to image rows attends to a zero image, is a batching artifact not copied).

    ``prefill_forward(tokens, images, page_table, kv_cache, prompt_lens, cross_page_table)`` is tt-metal's
    generator_vllm order; images per user: None, one image or a list (at most ``max_images_per_prompt``, default 1
    as tt-metal), or the processed inputs (`input_processor`'s, a BatchFeature). The prompt holds one <|image|>
    token per image; the cross-attention mask comes from the tokens (tt-metal's create_vision_mask) unless given.
    ``decode_forward(..., cross_page_table=)``: the masks are kept per slot by the generator."""

    model_capabilities = {"supports_prefix_caching": False, **_VISION_IN_JAX, "image_inputs": "cross_attention",
                          "cross_attention_kv": "device"}

    def prefill_forward(self, tokens, images=None, page_table=None, kv_cache=None, prompt_lens=None,
                        cross_page_table=None, **kwargs):
        return super().prefill_forward(tokens, page_table, kv_cache, prompt_lens, images=images,
                                       cross_page_table=cross_page_table, **kwargs)


class GptOssForCausalLM(HybridAttentionForCausalLM):
    pass



# ------------------------------------------------------------------------------------------------ DeepSeek
class DeepseekV4ForCausalLM(Generator):
    """DeepSeek V4 / V4.1: hybrid KV caches by kind (`kv_cache_specs`: per layer a window ring, and on kv sources the
    compressed CSA / HCA entries, indexer keys and compressor state), each with its own page table and buffer, run
    by `deepseek_emu.DeepSeekVLLMExecutor` (the default executor factory picks it).

    Caches are listed in `cache_names` order (the `kv_cache_specs` names): ``allocate_kv_cache_per_layer({name:
    (shape, dtype, tensor_idx)})`` returns ``[submesh][cache][0]`` buffers ``[num_blocks, 1, block_size, width]``
    (one tensor: the latent is read as both K and V); ``prefill_forward`` / ``decode_forward`` take
    ``page_tables_per_layer={name: int32 [batch, W]}``: token caches index positions, compressed / indexer caches
    entries (position // ratio), window rings ``sliding_ring_capacity`` tokens (``cache_position_modulo``).
    Chunked prefill: a prompt longer than ``max_prefill_chunk_size`` runs its first chunk through the prefill program
    and the rest through `DeepSeekVLLMExecutor.extend` (any position: mid compression group, mid window).
    ``start_pos`` continues a request whose caches already hold its first start_pos tokens (`prefix_blocks` says
    which blocks it may share with the request that computed them and which it needs copies of). Engram's n-gram
    hashes run on the host from each slot's last tokens, which the generator keeps (and, for a chunk, the prompt's).

    ``supports_prefix_caching`` stays False: vLLM's prefix cache hands a request the cached blocks themselves, and
    DeepSeek's window ring and a partly filled block of compressed entries are rewritten in place by the request
    that owns them (the ring holds the prefix's last tokens only while its writer stands at the prefix's end), so
    they would need copies taken at that moment, which vLLM's block manager does not make. vLLM then prefills whole
    prompts (chunked), which is always correct."""

    serves_deepseek = True
    model_capabilities = {"supports_prefix_caching": False}

    def prefix_blocks(self, n_cached: int) -> dict[str, dict]:
        """For a prefix of `n_cached` tokens (a multiple of the block size) in another request's caches: per cache
        (`cache_names`), ``{"share": k, "copy": [columns]}``: the new request's page table may hold the other's
        blocks in its first k columns, read-only, and needs private copies of the other's blocks in `copy` columns
        before its ``prefill_forward(start_pos=n_cached)``; its other columns are its own.

        * compressor state (token-indexed): every block of the prefix is shared; its rows depend on the prefix
          alone, and the compression group straddling n_cached reads its first rows there.
        * compressed entries and indexer keys (one row per ratio tokens): the blocks of complete entries are
          shared; a block only partly filled by the prefix's n_cached // ratio entries is copied (the request's
          later entries are written into it).
        * window ring: nothing shared, every column copied (the ring is rewritten in place)."""
        bs = self._require_block_size()
        if n_cached % bs:
            raise ValueError(f"a cached prefix covers whole blocks: {n_cached} is not a multiple of {bs}")
        out = {}
        for name, m, r in zip(self.cache_names(), self.cache_position_modulo(), self.tokens_per_entry()):
            if m:
                out[name] = {"share": 0, "copy": list(range(m // bs))}
            else:
                entries = n_cached // r
                out[name] = {"share": entries // bs, "copy": [entries // bs] if entries % bs else []}
        return out

    def _caches(self) -> list[dict]:
        return paged_caches(self.config)

    def _cache_label(self, i: int) -> str:
        return self.cache_names()[i]

    def _cross_caches(self) -> set[int]:
        return set()

    def tokens_per_entry(self) -> list[int]:
        return [c["tokens_per_entry"] for c in self._caches()]

    def cache_position_modulo(self) -> list[int | None]:
        """The window caches are rings (DeepSeek declares them `SlidingWindowSpec`s); the others full length."""
        bs = self._require_block_size()
        return [sliding_ring_capacity(c["ring"], bs) if c["kind"] == "window" else None for c in self._caches()]

    def allocate_kv_cache(self, kv_cache_shape, dtype, num_layers):
        raise ValueError("DeepSeek's caches differ by kind (width, tokens per row): allocate_kv_cache_per_layer("
                         "{name: (shape, dtype, tensor_idx)}) with the kv_cache_specs names")

    def allocate_kv_cache_per_layer(self, per_layer_specs):
        """``{name: (shape, dtype, tensor_idx)}`` for every `cache_names` entry -> ``[submesh][cache][0]`` zero
        buffers; caches with one tensor_idx share one buffer (their page tables must map disjoint blocks)."""
        names = self.cache_names()
        if not isinstance(per_layer_specs, dict) or set(per_layer_specs) != set(names):
            got = sorted(per_layer_specs) if isinstance(per_layer_specs, dict) else type(per_layer_specs).__name__
            raise ValueError(f"DeepSeek caches are allocated by name: need exactly {names}, got {got}")
        bs = int(per_layer_specs[names[0]][0][2])
        if self.block_size not in (None, bs):
            raise ValueError(f"block_size {bs} differs from the generator's {self.block_size}")
        specs = kv_cache_specs(self.config, bs, "bfloat16")
        for name in names:
            shape, spec = tuple(per_layer_specs[name][0]), specs[name]
            want = (spec.num_kv_heads, bs, spec.head_size)
            if len(shape) != 4 or shape[1:] != want:
                raise ValueError(f"{name}: kv_cache_shape {shape} must be [num_blocks, {', '.join(map(str, want))}]")
        self.block_size = bs
        pairs = [pc.allocate_shared_buffers([(s, _np_dtype(d), t) for s, d, t in
                                             (per_layer_specs[n] for n in names)]) for _ in range(self.data_parallel)]
        return [[pair[:1] for pair in sub] for sub in pairs]

    def _page_tables_per_layer(self, page_table, page_tables_per_layer) -> list[np.ndarray]:
        names = self.cache_names()
        if not isinstance(page_tables_per_layer, dict):
            why = " (one page_table cannot address entry-indexed caches)" if page_table is not None else ""
            raise ValueError("DeepSeek's caches are addressed per kind: pass page_tables_per_layer={name: int32 "
                             f"[batch, blocks]}} for {names}{why}")
        if set(page_tables_per_layer) != set(names):
            missing, extra = sorted(set(names) - set(page_tables_per_layer)), sorted(set(page_tables_per_layer) -
                                                                                   set(names))
            raise ValueError(f"page_tables_per_layer: missing {missing}, unknown {extra}")
        tables = [np.asarray(page_tables_per_layer[n]) for n in names]
        for name, t in zip(names, tables):
            if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer) or t.shape[0] != tables[0].shape[0]:
                raise ValueError(f"page table {name}: must be an integer [batch, blocks] array with as many rows as "
                                 f"the others ({tables[0].shape[0]}), got {t.dtype} {list(t.shape)}")
        return [t.astype(np.int32) for t in tables]

    def _check_kv(self, kv_cache) -> None:
        n = len(self._caches())
        if kv_cache is None or len(kv_cache) != self.data_parallel or any(len(sub) != n for sub in kv_cache):
            raise ValueError(f"kv_cache must hold, per submesh ({self.data_parallel}), one [buffer] per cache ({n}, in "
                             "cache_names order): allocate_kv_cache_per_layer's result")


class DeepseekV41ForCausalLM(DeepseekV4ForCausalLM):
    pass
