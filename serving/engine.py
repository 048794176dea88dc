"""The engine: requests in, one scheduled step at a time, token and text deltas out.

    engine = Engine(model, EngineConfig(max_num_seqs=64, kv_blocks=4096))
    engine.add("r1", prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work():
        for out in engine.step(): ...

Single-threaded: the HTTP server drives it from one thread. `step()` never raises for a bad request (those are
refused by `add` with a ValueError naming the field); running out of blocks preempts, never fails.
"""
from __future__ import annotations

import hashlib
import logging
import random
import time
from dataclasses import dataclass

import jax
import numpy as np

from jaxmodels.generate import eos_ids
from jaxmodels.layers import vision
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
    kv_blocks: int | None = None  # blocks per pool; default: memory_fraction of the device, or (no memory
    # statistics, e.g. the CPU) enough for max_num_seqs sequences of max_model_len
    memory_fraction: float = 0.9  # of the device memory left after the parameters
    block_size: int = 16
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("max_model_len", "kv_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig()):
        cfg = model.config
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        limit = cfg.max_position_embeddings
        self.max_model_len = config.max_model_len or min(limit, 8192)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        bs = config.block_size
        groups, abstract, buffer_space, stateful = R.groups_of(cfg, self.max_model_len, bs, model.dtype)
        per_block = R.block_bytes(abstract, buffer_space)
        need = [sum(g.entries for g in groups if g.space == s) for s in range(len(per_block))]  # one sequence
        blocks = config.kv_blocks or self._size(per_block, need)
        if blocks < max(need):
            raise ValueError(f"kv_blocks={blocks} cannot hold one sequence of max_model_len={self.max_model_len} "
                             f"(needs {max(need)} blocks of {bs} tokens); lower max_model_len or raise kv_blocks")
        self.runner = R.Runner(model, groups, abstract, buffer_space, blocks, config.max_num_seqs,
                               self.max_model_len, bs)
        chunked = config.enable_chunked_prefill and self.runner.extend_ok
        self.pool = KVPool(groups, blocks, bs, config.enable_prefix_caching and self.runner.extend_ok)
        if config.enable_prefix_caching and not self.pool.prefix_caching:
            log.warning("prefix caching is off for %s: %s", cfg.family,
                        "its cache keeps per-sequence state" if stateful or not self.runner.extend_ok else
                        f"a sliding window is not a multiple of block_size={bs}")
        if self.pool.prefix_caching and not chunked and any(g.ring for g in groups):
            log.warning("without chunked prefill a prompt longer than a sliding window writes over its own ring "
                        "blocks: prefix caching will rarely hit")
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   chunked)
        self.requests: dict[str, Request] = {}
        self.eos = frozenset(eos_ids(cfg, self.tokenizer))
        self.blocks, self.steps = blocks, 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "cached_prompt_tokens": 0}
        self.history: list[dict] = []  # per step, when `record` is on: who ran, how many tokens, blocks used
        self.record = False
        log.info("engine: %d blocks of %d tokens per pool (%s), max_num_seqs=%d, max_model_len=%d", blocks, bs,
                 ", ".join(f"{g.name}: pool {g.space}" for g in groups), config.max_num_seqs, self.max_model_len)

    def _size(self, per_block: list[int], need: list[int]) -> int:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return self.config.max_num_seqs * max(need)
        free = (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * self.config.memory_fraction
        return max(1, int(free // sum(per_block)))

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
        req.detok = Detokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                params.include_stop_str_in_output, context=req.prompt)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _images(self, req: Request, images: dict) -> None:
        """Encode a request's images once, at arrival; their embeddings replace its image tokens chunk by chunk."""
        cfg = self.model.config
        if cfg.vision is not None and cfg.vision.kind == "mllama":
            raise ValueError("the server does not take Mllama images yet (jm.generate does)")
        arrays, static = vision.inputs(cfg, np.asarray([req.prompt]), images)
        if not arrays:
            return
        if not self.runner.extend_ok:
            raise ValueError(f"{cfg.family} serves no images")
        feats, valid = R.encode_images(self.model.params, arrays, cfg=cfg, static=static)
        req.features = feats[np.flatnonzero(np.asarray(valid))]
        h = hashlib.sha256()
        for name in sorted(images):
            h.update(name.encode() + np.ascontiguousarray(images[name]).tobytes())
        req.salt = h.digest()
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
        return self.scheduler.has_work()

    # ----------------------------------------------------------------------------------------------- a step
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch.pieces:
            return []
        self.runner.copy(self.pool.take_copies())
        for req in batch.admitted:
            if req.params.penalized:  # the row's counts: this request's generated tokens so far
                self.runner.reset_counts(req.row, req.output)
        decode = [p for p in batch.pieces if p[2] == 1 and (p[1] > 0 or self.runner.extend_ok)
                  and (p[0].features is None or p[1] >= len(p[0].prompt))]  # image tokens go through extend
        chunks = [p for p in batch.pieces if p not in decode]
        results = []
        if chunks:
            how = "extend" if self.runner.extend_ok else "prefill"
            results += zip(chunks, self.runner.run(how, chunks))
        if decode:
            results += zip(decode, self.runner.run("decode", decode))
        now = time.monotonic()
        outputs = []
        for (req, start, n), (tok, logprob, top_ids, top_lp) in results:
            req.computed = start + n
            if req.computed < len(req.tokens):  # a prefill chunk: no token yet
                self.pool.register(req.blocks, req.tokens, req.computed)
                continue
            outputs.append(self._emit(req, tok, logprob, top_ids, top_lp, now))
        self.steps += 1
        if self.record:
            self.history.append({"step": self.steps, "time": now,
                                 "ran": [(r.id, s, n) for r, s, n in batch.pieces],
                                 "preempted": [r.id for r in batch.preempted],
                                 "blocks_used": [self.pool.used(s) for s in range(len(self.pool.spaces))]})
        return outputs

    def _emit(self, req: Request, tok: int, logprob: float, top_ids, top_lp, now: float) -> StepOutput:
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = now
            self.counters["prompt_tokens"] += len(req.prompt)
            self.counters["cached_prompt_tokens"] += req.cached
        req.generated += 1
        self.counters["generation_tokens"] += 1
        new, lps = [], []
        if tok in req.eos:
            req.finish_reason = "stop"
        else:
            req.output.append(tok)
            new = [tok]
            if p.logprobs is not None:
                lps = [Logprob(tok, logprob, [(int(i), float(v)) for i, v in zip(top_ids[:p.logprobs], top_lp)])]
                req.logprobs += lps
        text = req.detok.push(new)
        if req.detok.stopped:
            req.finish_reason = "stop"
        elif req.finish_reason is None and (len(req.output) >= (p.max_tokens or self.max_model_len)
                                            or len(req.tokens) >= self.max_model_len):
            req.finish_reason = "length"
        self.pool.register(req.blocks, req.tokens, req.computed)  # finished too: its prompt serves the next one
        if req.finished:
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
