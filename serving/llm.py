"""Offline inference through the engine: many prompts, continuous batching, one call.

    from serving import LLM, SamplingParams
    llm = LLM("converted/")                       # a jm.Model, a converted dir or a source checkpoint
    outs = llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0.8, max_tokens=64, seed=0))
    outs[0].outputs[0].text
"""
from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from serving.engine import Engine, EngineConfig
from serving.request import CompletionOutput, RequestOutput, SamplingParams


def load_model(model_or_path, dtype: str | None = None):
    import jaxmodels as jm

    return model_or_path if isinstance(model_or_path, jm.Model) else jm.load(model_or_path, dtype=dtype)


def prompt_ids(prompt, tokenizer) -> list[int]:
    """A prompt as token ids: a string (encoded with the model's tokenizer) or a list of ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return [int(t) if not isinstance(t, bool) and float(t) == int(t) else _bad(t) for t in prompt]


def _bad(t):
    raise ValueError(f"token id {t!r} is not an int")


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """n completions of one prompt as n engine requests: seeds seed, seed+1, … keep them reproducible and distinct."""
    import dataclasses

    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**32)
            for i in range(params.n)]


class LLM:
    def __init__(self, model_or_path, dtype: str | None = None, warmup: tuple[str, ...] = (), **engine_args):
        """engine_args: EngineConfig's fields. warmup: compile every step shape first for these kinds of rows
        (`Engine.warmup`: "greedy", "sampled", "filtered"), so that no generate() call compiles mid-run."""
        self.model = load_model(model_or_path, dtype)
        self.engine = Engine(self.model, EngineConfig(**engine_args))
        if warmup:
            self.engine.warmup(warmup)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, images: list[list] | None = None) -> list[RequestOutput]:
        """Complete every prompt (a string, a token-id list, or a list of either); outputs in prompt order.
        images: a vision model's images, one list per prompt, placed as `jm.generate` places them."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        per_prompt = [(prompt_ids(p, self.tokenizer), None) for p in prompts] if images is None else \
            self._with_images(prompts, images)
        outs, owner = [], {}
        for (ids, arrays), sp in zip(per_prompt, params):
            out = RequestOutput(str(next(self._ids)), ids, [])
            for i, one in enumerate(fan_out(sp)):
                rid = f"{out.request_id}-{i}"
                self.engine.add(rid, ids, one, arrays)
                out.outputs.append(CompletionOutput(i, "", [], None, [] if one.logprobs is not None else None))
                owner[rid] = out.outputs[i]
            outs.append(out)
        bar = tqdm(total=len(owner), desc="requests", disable=not use_tqdm, unit="req")
        try:
            while self.engine.has_work():
                for step in self.engine.step():
                    c = owner[step.request_id]
                    c.token_ids += step.token_ids
                    c.text += step.text
                    if c.logprobs is not None:
                        c.logprobs += step.logprobs
                    if step.finished:
                        c.finish_reason = step.finish_reason
                        bar.update(1)
        except BaseException:  # interrupted: leave the engine empty for the next call
            for rid in owner:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return outs

    def _with_images(self, prompts, images) -> list[tuple[list[int], dict | None]]:
        from jaxmodels import multimodal

        if not isinstance(images, list) or len(images) != len(prompts):
            raise ValueError(f"images: one list per prompt ({len(prompts)})")
        return [(ids[0], arrays or None) for ids, arrays in
                (multimodal.prepare(self.model, [p], [row]) for p, row in zip(prompts, images))]
