"""The engine: requests in, one scheduled step at a time, token and text deltas out.

    engine = Engine(model, EngineConfig(max_num_seqs=64, kv_blocks=4096))
    engine.add("r1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for out in engine.step(): ...

Single-threaded: the HTTP server drives it from one thread. `step()` never raises for a bad request (those are
refused by `add` with a ValueError naming the field); running out of blocks preempts, never fails.

Asynchronous scheduling (`async_scheduling`, on by default, as vLLM's and SGLang's overlap schedulers): `step()`
schedules and dispatches step N+1 *before* it reads step N's tokens, so the host's work (reading tokens back,
detokenizing, stop checks, scheduling, building the next inputs) runs while the device computes. A decode row of
step N+1 takes its input token from the device (what step N sampled); only the sampled token ids come back, one
small transfer per step. The outputs `step()` returns are therefore those of the previous dispatch; a request that
finished there (EOS, a stop string, an abort) drops the extra token its row computed meanwhile. Results are the
same tokens as without the overlap.

Speculative decoding (`num_speculative_tokens` k > 0, models with their own draft heads: DeepSeek V4's MTP, V4.1's
DSpark): a decoding request's step proposes k tokens, verifies them in one pass and emits the accepted run plus one
(`runner.verify_step`); greedy output is the plain engine's, sampled output has the target's distribution. Each
step's positions then depend on the tokens accepted, which the host must read first: a speculating engine does
not overlap (vLLM's first speculative engines did the same). Requests with penalties or images decode plainly.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import jax
import numpy as np

from jaxmodels.generate import eos_ids
from jaxmodels.layers import vision
from jaxmodels import sharding
from serving import runner as R
from serving.detok import Detokenizer
from serving.kv_pool import KVPool
from serving.request import Logprob, Request, SamplingParams, StepOutput
from serving.scheduler import Scheduler

log = logging.getLogger("jaxmodels.serving")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings, at most 8192
    kv_blocks: int | None = None  # blocks per pool; default: from memory_fraction where the device reports its
    # memory, else (the CPU) enough for max_num_seqs sequences of max_model_len
    # the share of each device's memory (JAX's bytes_limit) the engine may fill, parameters included (vLLM's
    # gpu_memory_utilization): the KV pools get fraction * limit - bytes in use; None: 0.9 where the device reports
    # its memory. Set on a device that reports none (the CPU), it is refused: pass kv_blocks.
    memory_fraction: float | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True  # overlap the host's work with the device step (module docstring)
    # images one request may hold (vLLM's limit_mm_per_prompt); None: any number, except for Mllama, whose
    # cross-attention K/V every row keeps for this many images (rows x images x tiles x patches): 1 there
    max_images_per_prompt: int | None = None
    num_speculative_tokens: int = 0  # k > 0: speculative decoding with the model's draft heads (module docstring)

    def __post_init__(self):
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
        if k and self.max_num_batched_tokens < k + 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one speculative step "
                             f"(num_speculative_tokens + 1 = {k + 1} tokens)")
        for name in ("max_model_len", "kv_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        v = self.max_images_per_prompt
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"max_images_per_prompt must be an int >= 0, got {v!r}")
        if self.memory_fraction is not None and not (
                isinstance(self.memory_fraction, (int, float)) and not isinstance(self.memory_fraction, bool)
                and 0 < self.memory_fraction <= 1):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")


DEFAULT_MEMORY_FRACTION = 0.9


def memory_stats(devices) -> list[dict | None]:
    """Each device's `memory_stats()` (None where the platform keeps none, as the CPU)."""
    return [d.memory_stats() for d in devices]


def kv_blocks_for_memory(block_bytes: list[int], stats: list[dict | None], fraction: float,
                         names: list[str] | None = None, reserved: int = 0) -> int:
    """How many blocks fit each device's share: floor((fraction * bytes_limit - bytes_in_use - reserved) /
    block_bytes) at the tightest device. block_bytes: what one block (of every pool) takes on each device; stats:
    each device's `memory_stats()`; reserved: bytes every device keeps besides (Mllama's per-row cross-attention
    K/V). Raises ValueError naming the device that reports no memory or has no room."""
    names = names or [f"device {i}" for i in range(len(stats))]
    best = None
    for per, st, name in zip(block_bytes, stats, names):
        if not st or "bytes_limit" not in st:
            raise ValueError(f"{name} reports no memory statistics, so memory_fraction cannot size the KV cache; "
                             f"pass kv_blocks (--kv-blocks)")
        room = fraction * st["bytes_limit"] - st.get("bytes_in_use", 0) - reserved
        n = int(room // per) if room > 0 else 0
        if n < 1:
            raise ValueError(f"memory_fraction={fraction} of {name}'s {st['bytes_limit'] / 2**30:.2f} GiB leaves no "
                             f"room for one KV block ({per} bytes) beside the "
                             f"{st.get('bytes_in_use', 0) / 2**30:.2f} GiB in use; raise it or pass kv_blocks")
        best = n if best is None else min(best, n)
    return best


def image_count(v, arrays: dict, static: tuple) -> int:
    """How many images a request's processed images (checked by `vision.inputs`) hold."""
    grids = dict(static)
    if "image_grid_hw" in grids or "image_grid_thw" in grids:
        return len(grids.get("image_grid_hw", grids.get("image_grid_thw")))
    return int(np.shape(arrays["pixel_values"])[1 if v.kind == "mllama" else 0])


def _mllama_slots(a: dict, slots: int) -> dict:
    """Mllama's images of one request [1, N, ...] padded to the engine's `slots` images as the processor pads a
    batch's rows (no pixels, aspect ratio id 0, tile 0 marked), and its tokens' tile mask [prompt, slots, tiles]."""
    pv, ids, mask = a["pixel_values"][0], a["aspect_ratio_ids"][0], a["aspect_ratio_mask"][0]
    n, pad = pv.shape[0], slots - pv.shape[0]
    tiles = a["cross_attention_mask"][0]
    pad_mask = np.zeros((pad, mask.shape[1]), mask.dtype)
    pad_mask[:, 0] = 1
    return {"pixel_values": np.concatenate([pv, np.zeros((pad, *pv.shape[1:]), pv.dtype)]),
            "aspect_ratio_ids": np.concatenate([ids, np.zeros(pad, ids.dtype)]),
            "aspect_ratio_mask": np.concatenate([mask, pad_mask]),
            "cross_attention_mask": np.pad(tiles, ((0, 0), (0, slots - n), (0, 0)))}


def _check_drafter(model, k: int) -> None:
    """Speculative decoding needs the model's own draft heads, loaded; DSpark drafts at most its block."""
    cfg = model.config
    if cfg.mtp is None or "mtp" not in model.params:
        raise ValueError(f"num_speculative_tokens={k} needs a model with MTP draft heads (DeepSeek V4 / V4.1 loaded "
                         f"with its mtp.* tensors); {cfg.family} has none")
    if cfg.mtp.kind == "dspark" and k > cfg.mtp.block_size:
        raise ValueError(f"num_speculative_tokens={k} exceeds the DSpark block size {cfg.mtp.block_size}")


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig()):
        cfg = model.config
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        limit = cfg.max_position_embeddings
        self.max_model_len = config.max_model_len or min(limit, 8192)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        bs = config.block_size
        v = cfg.vision
        self.max_images = config.max_images_per_prompt
        if self.max_images is None and v is not None and v.kind == "mllama":
            self.max_images = 1
        cross_tokens = 0  # Mllama: the image-feature tokens each row's cross-attention layers keep
        if v is not None and v.kind == "mllama" and self.max_images:
            cross_tokens = self.max_images * v.max_tiles * ((v.image_size // v.patch_size) ** 2 + 1)
        self.k = k = config.num_speculative_tokens
        if k:
            _check_drafter(model, k)
        groups, abstract, buffer_space, stateful = R.groups_of(cfg, self.max_model_len, bs, model.dtype,
                                                               cross_tokens, k)
        per_block = R.block_bytes(abstract, buffer_space)
        need = [sum(g.entries for g in groups if g.space == s) for s in range(len(per_block))]  # one sequence
        blocks = config.kv_blocks or self._size(abstract, need)
        if blocks < max(need):
            raise ValueError(f"kv_blocks={blocks} cannot hold one sequence of max_model_len={self.max_model_len} "
                             f"(needs {max(need)} blocks of {bs} tokens); lower max_model_len or raise kv_blocks")
        self.runner = R.Runner(model, groups, abstract, buffer_space, blocks, config.max_num_seqs,
                               self.max_model_len, bs, cross_tokens, k)
        if k and not self.runner.extend_ok:
            raise ValueError(f"num_speculative_tokens needs chunked extend, which {cfg.family} does not run")
        chunked = config.enable_chunked_prefill and self.runner.extend_ok
        self.pool = KVPool(groups, blocks, bs, config.enable_prefix_caching and self.runner.extend_ok,
                           rows=self.runner.rows)
        if config.enable_prefix_caching and not self.pool.prefix_caching:
            log.warning("prefix caching is off for %s: %s", cfg.family,
                        "its cache keeps per-sequence state" if stateful or not self.runner.extend_ok else
                        f"a sliding window is not a multiple of block_size={bs}")
        if self.pool.prefix_caching and not chunked and any(g.ring for g in groups):
            log.warning("without chunked prefill a prompt longer than a sliding window writes over its own ring "
                        "blocks: prefix caching will rarely hit")
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   chunked, k)
        # a chunk launch of several rows pads to at most twice a step's budget (rarely binding: splitting is
        # cheaper well before), so that `warmup` knows every shape a step can launch
        self.launch_tokens = 2 * R.chunk_width(self.scheduler.budget)
        self.requests: dict[str, Request] = {}
        self.eos = frozenset(eos_ids(cfg, self.tokenizer))
        self.blocks, self.steps = blocks, 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_prompt_tokens": 0,
                         # speculative decoding: row steps verified, drafts proposed, drafts the rule accepted,
                         # tokens the requests took from those steps (fewer where a request ended inside a run)
                         "spec_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_emitted_tokens": 0}
        self.history: list[dict] = []  # per step, when `record` is on: who ran, how many tokens, blocks used
        self.record = False
        self.async_scheduling = config.async_scheduling  # may be switched between steps (no effect when speculating)
        if k and config.async_scheduling:
            log.info("speculative decoding: the engine reads each step's tokens before it schedules the next")
        self.inflight: list = []  # the dispatched step whose tokens have not been read yet (async scheduling)
        # host time: seconds in step() in all, and of them blocked waiting for the device's tokens
        self.timing = {"steps": 0, "step_s": 0.0, "wait_s": 0.0}
        log.info("engine: %d blocks of %d tokens per pool (%s), max_num_seqs=%d, max_model_len=%d", blocks, bs,
                 ", ".join(f"{g.name}: pool {g.space}" for g in groups), config.max_num_seqs, self.max_model_len)

    def _size(self, abstract, need: list[int]) -> int:
        """Blocks per pool from the devices' memory (kv_blocks_for_memory), each device's share of a block as the
        sharding rules split the pools."""
        mesh = self.model.mesh
        devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
        stats = memory_stats(devices)
        if self.config.memory_fraction is None and not all(st and "bytes_limit" in st for st in stats):
            blocks = self.config.max_num_seqs * max(need)
            log.info("%s reports no memory statistics: %d blocks, for %d sequences of max_model_len", devices[0],
                     blocks, self.config.max_num_seqs)
            return blocks
        shard = self.model.sharding
        per = 0  # bytes of one block on a device: the pools shard alike on every device
        for buf in abstract.buffers:
            shape = buf.shape[:1] + (1,) + buf.shape[2:]
            n = int(np.prod(shape)) * buf.dtype.itemsize
            if shard is not None:
                spec = sharding.spec_for(R.BUFFER_AXES, shape, shard.mesh, dict(shard.rules))
                n //= int(np.prod([shard.mesh.shape[a] for axes in spec if axes
                                   for a in ((axes,) if isinstance(axes, str) else axes)]))
            per += n
        rows = self.config.max_num_seqs + 1  # the per-row state, replicated on every device
        state = rows * sum(int(np.prod(a.shape)) * a.dtype.itemsize for kind in abstract.state for a in kind.values())
        if self.k:  # the drafter's rows, replicated too
            draft = jax.eval_shape(R.draft_state, self.model.config, rows, self.max_model_len, self.model.dtype, self.k)
            state += sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(draft))
        return kv_blocks_for_memory([per] * len(devices), stats, self.config.memory_fraction or
                                    DEFAULT_MEMORY_FRACTION, [str(d) for d in devices], state)

    def launch_shapes(self) -> list[tuple[str, int, int]]:
        """Every (kind, rows, tokens) a step can launch for text requests."""
        sch = self.scheduler
        longest = min(sch.budget, sch.max_chunk or sch.budget, self.max_model_len)
        shapes = R.launch_shapes(self.runner.rows - 1, longest, self.launch_tokens)
        chunk = "extend" if self.runner.extend_ok else "prefill"
        # a speculating engine verifies its decodes (a vision model's requests with images decode plainly)
        decode = (["verify"] + (["decode"] if self.model.config.vision is not None else [])) if self.k else ["decode"]
        return [(chunk, P, T) for P, T in shapes["chunk"]] + [(d, P, T) for d in decode for P, T in shapes["decode"]]

    def copy_sizes(self) -> list[int]:
        """The block counts (powers of two) a step's copy-on-write may copy: at most the blocks a step's tokens
        touch, per group (a chunk's first and last block may be partial). None without prefix caching (an empty
        list): blocks are shared only through the cache."""
        if not self.pool.prefix_caching:
            return []
        sch, rows = self.scheduler, self.runner.rows - 1
        most = (sch.budget // self.pool.block_size + 2 * rows) * len(self.pool.groups)
        return [1 << b for b in range(R.bucket(most).bit_length())]

    def warmup(self, sampling=("greedy",), workers: int | None = None, progress=None) -> int:
        """Compile the step of every shape `launch_shapes` lists, for rows that are greedy / sampled / sampled with
        top-k, top-p or min-p (`sampling`, names of `runner.WARM_SAMPLING`), and every copy-on-write size — so
        that no request waits for a compile later (steps with penalties, logprobs or images still compile when
        first met). Shapes are traced here, one after another (tracing reads this thread's JAX config: warm up in
        the thread that steps the engine), and compiled meanwhile in `workers` threads (default: the CPU count, at
        most 8). progress(done, total) after each compile. Returns the programs compiled."""
        sampling = (sampling,) if isinstance(sampling, str) else tuple(sampling)
        unknown = set(sampling) - set(R.WARM_SAMPLING)
        if unknown:
            raise ValueError(f"warm-up sampling must be among {sorted(R.WARM_SAMPLING)}, got {sorted(unknown)}")
        t, workers = time.perf_counter(), workers or min(8, os.cpu_count() or 1)
        pool = ThreadPoolExecutor(workers)
        try:
            jobs = {}  # future -> the step's key (a tuple), or copy_blocks' block count (an int)
            for s in dict.fromkeys(sampling):
                for how, P, T in self.launch_shapes():
                    if (low := self.runner.lower(how, P, T, s)) is not None:
                        jobs[pool.submit(low[1].compile)] = low[0]
            for n in self.copy_sizes():
                if n not in self.runner.copies_compiled:
                    jobs[pool.submit(self.runner.lower_copy(n).compile)] = n
            for done, job in enumerate(as_completed(jobs), 1):
                job.result()
                key = jobs[job]
                (self.runner.shapes if isinstance(key, tuple) else self.runner.copies_compiled).add(key)
                if progress:
                    progress(done, len(jobs))
        except BaseException:  # a failed compile or Ctrl-C: do not wait for the queued ones
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        if jobs:
            log.info("warm-up: %d programs compiled in %.1f s (%s; %d threads)", len(jobs),
                     time.perf_counter() - t, ", ".join(sampling), workers)
        return len(jobs)

    # -------------------------------------------------------------------------------------------- requests
    def add(self, request_id: str, prompt: list[int], params: SamplingParams, images: dict | None = None) -> None:
        """Queue a request (prompt: token ids; a vision model's images processed by its HF names, as
        `jaxmodels.multimodal.prepare` gives them, the prompt holding their tokens). Raises ValueError for anything
        it could not serve."""
        vocab = self.model.config.vocab_size
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt has no tokens")
        bad = next((t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt + at least one generated token)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if params.n != 1:
            raise ValueError("the engine runs n=1 requests; LLM and the server fan n out")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        eos = frozenset() if params.ignore_eos else self.eos
        req = Request(request_id, [int(t) for t in prompt], params, eos | frozenset(params.stop_token_ids), seed)
        if images:
            self._images(req, images)
        # speculative rows apply no penalties; image requests keep to the plain path generate() checks
        req.draft = 0 if params.penalized or req.features is not None or req.cross is not None else self.k
        req.detok = Detokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                params.include_stop_str_in_output, context=req.prompt)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _images(self, req: Request, images: dict) -> None:
        """Encode a request's images once, at arrival; their embeddings replace its image tokens chunk by chunk
        (Mllama: its images go to the prefill, whose cross-attention K/V the row keeps for its decode steps)."""
        cfg = self.model.config
        arrays, static = vision.inputs(cfg, np.asarray([req.prompt]), images)
        if "pixel_values" not in arrays:
            return
        count = image_count(cfg.vision, arrays, static)
        if self.max_images is not None and count > self.max_images:
            raise ValueError(f"the prompt has {count} images; this engine takes at most {self.max_images} per prompt "
                             f"(max_images_per_prompt)")
        h = hashlib.sha256()
        for name in sorted(images):
            h.update(name.encode() + np.ascontiguousarray(images[name]).tobytes())
        req.salt = h.digest()
        if cfg.vision.kind == "mllama":
            req.cross = _mllama_slots({k: np.asarray(a) for k, a in arrays.items()}, self.max_images)
            return
        feats, valid = R.encode_images(self.model.params, arrays, cfg=cfg, static=static)
        req.features = feats[np.flatnonzero(np.asarray(valid))]
        if cfg.vision.kind == "siglip":  # each image's soft tokens attend to each other: one chunk holds them
            is_img = np.asarray(req.prompt) == cfg.vision.image_token_id
            edges = np.flatnonzero(np.diff(np.concatenate([[0], is_img.astype(np.int8), [0]])))
            req.spans = tuple(zip(edges[0::2].tolist(), edges[1::2].tolist()))
            longest = max((b - a for a, b in req.spans), default=0)
            limit = min(self.scheduler.budget, self.scheduler.max_chunk or self.scheduler.budget)
            if longest > limit:
                raise ValueError(f"an image takes {longest} tokens, more than a prefill chunk holds ({limit}); "
                                 f"raise max_num_batched_tokens")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free every block it holds. False if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.inflight)

    # ----------------------------------------------------------------------------------------------- a step
    def step(self) -> list[StepOutput]:
        """Schedule and dispatch a step; return the outputs of the previous one (async scheduling) or of this one."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.pieces else []
        if self.async_scheduling and not self.k:
            done, self.inflight = self.inflight, launched
        else:
            done, self.inflight = self.inflight + launched, []
        outputs = self._collect(done) if done else []
        if batch.pieces:
            self.steps += 1
            if self.record:
                self.history.append({"step": self.steps, "time": time.monotonic(),
                                     "ran": [(r.id, s, n) for r, s, n in batch.pieces],
                                     "preempted": [r.id for r in batch.preempted],
                                     "blocks_used": [self.pool.used(s) for s in range(len(self.pool.spaces))]})
        self.timing["steps"] += 1
        self.timing["step_s"] += time.perf_counter() - t0
        return outputs

    def _launch(self, batch) -> list:
        """Dispatch the batch (extend or prefill chunks, then decodes) without waiting for the device."""
        self.runner.copy(self.pool.take_copies())
        for req in batch.admitted:
            self.runner.admit(req)
        decode, verify, chunks = [], [], []
        for p in batch.pieces:
            req, start, n = p
            if req.draft:  # a speculating request verifies drafts after its generated tokens, and its drafter
                (verify if req.verifies(start, n) else chunks).append(p)  # follows every other piece (chunks)
                continue
            images = req.features is not None or req.cross is not None  # image tokens go through extend / prefill
            is_decode = n == 1 and (start > 0 or self.runner.extend_ok) and (not images or start >= len(req.prompt))
            (decode if is_decode else chunks).append(p)
        table, out = self.pool.table, []
        # Mllama: rows with images run apart (in a batch, a row without images would attend to the others' padding)
        for part in ([p for p in chunks if p[0].cross is None], [p for p in chunks if p[0].cross is not None]):
            for rows in R.row_groups(part, cap=self.runner.rows - 1, max_tokens=self.launch_tokens):
                out.append(self.runner.run("extend" if self.runner.extend_ok else "prefill", rows, table))
        if decode:
            out.append(self.runner.run("decode", decode, table))
        if verify:
            out.append(self.runner.run("verify", verify, table))
        return out

    def _collect(self, launched: list) -> list[StepOutput]:
        """Read a dispatched step's tokens back (the one wait for the device) and emit them."""
        t = time.perf_counter()
        results = [x.fetch() for x in launched]
        self.timing["wait_s"] += time.perf_counter() - t
        now = time.monotonic()
        outputs = []
        for x, res in zip(launched, results):
            if x.how == "verify":
                outputs += self._collect_verified(x, res, now)
                continue
            toks = res[0].tolist()
            for i, (req, _, _) in enumerate(x.pieces):
                if not x.emit[i]:  # a prefill chunk: no token yet
                    continue
                req.pending -= 1
                if req.finished:  # finished (or aborted) after this step was dispatched: its token is dropped
                    continue
                lp = (res[1][i], res[2][i], res[3][i]) if len(res) > 1 else None
                new, lps = self._accept(req, toks[i], lp, now)
                outputs.append(self._close(req, new, lps, req.detok.push(new)))
        return outputs

    def _collect_verified(self, x, res, now: float) -> list[StepOutput]:
        """A verify step's runs: each request takes its count tokens, one at a time until one ends it; its cache
        holds the positions of the kept drafts (the rejected ones' writes lie past them, overwritten later)."""
        toks, counts = res[0].tolist(), res[1].tolist()
        c, outputs = self.counters, []
        for i, (req, start, _) in enumerate(x.pieces):
            req.pending -= 1
            if req.finished:
                continue
            count = counts[i]
            req.computed += count - 1
            c["spec_steps"] += 1
            c["spec_draft_tokens"] += min(self.k, self.max_model_len - 1 - start)  # the drafts its cache can verify
            c["spec_accepted_tokens"] += count - 1
            new, lps, text = [], [], ""
            for j in range(count):
                lp = (res[2][i][j], res[3][i][j], res[4][i][j]) if len(res) > 2 else None
                tok, lp = self._accept(req, toks[i][j], lp, now)
                new, lps, text = new + tok, lps + lp, text + req.detok.push(tok)
                c["spec_emitted_tokens"] += 1
                if req.finished or req.detok.stopped or self._at_limit(req):
                    break
            outputs.append(self._close(req, new, lps, text))
        return outputs

    def _accept(self, req: Request, tok: int, lp, now: float) -> tuple:
        """A sampled token joins its request (an EOS / stop id ends it instead)."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = now
            self.counters["prompt_tokens"] += len(req.prompt)
            self.counters["cached_prompt_tokens"] += req.cached
        req.generated += 1
        self.counters["generation_tokens"] += 1
        if tok in req.eos:
            req.finish_reason = "stop"
            return [], []
        req.append(tok)
        lps = []
        if p.logprobs is not None:
            logprob, top_ids, top_lp = lp
            lps = [Logprob(tok, float(logprob), [(int(i), float(v)) for i, v in zip(top_ids[:p.logprobs], top_lp)])]
            req.logprobs += lps
        return [tok], lps

    def _at_limit(self, req: Request) -> bool:
        """The request holds max_tokens generated tokens, or max_model_len tokens in all."""
        return (len(req.output) >= (req.params.max_tokens or self.max_model_len)
                or len(req.tokens) >= self.max_model_len)

    def _close(self, req: Request, new: list[int], lps: list, text: str) -> StepOutput:
        """The token's text is known (`text`, from the detokenizer): a stop string or a length limit ends the
        request, which then frees its blocks, its prompt's staying cached."""
        if req.detok.stopped:
            req.finish_reason = "stop"
        elif req.finish_reason is None and self._at_limit(req):
            req.finish_reason = "length"
        if req.finished:
            if req.blocks is not None:  # its prompt serves the next one
                self.pool.register(req.blocks, req.tokens, req.computed)
            text += req.detok.finish()
            if req.detok.stopped:  # a stop string the whole-output decode found
                req.finish_reason = "stop"
            self.scheduler.finish(req)
            self.requests.pop(req.id, None)
        return StepOutput(req.id, new, text, req.finished, req.finish_reason, lps)

    # -------------------------------------------------------------------------------------------- metrics
    def stats(self) -> dict:
        pool = self.pool
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks": self.blocks,
                "blocks_used": {g.name: pool.used(g.space) for g in pool.groups},
                "prefix_hit_rate": pool.hit_rates(), "preemptions": self.scheduler.preemptions,
                "steps": self.steps, "compiled_shapes": len(self.runner.shapes), **self.counters}
