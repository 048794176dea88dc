"""Continuous batching: which requests run in the next step, and how many of their tokens.

Each step has a token budget. Running requests go first, in arrival order: a decoding one needs 1 token, one still
prefilling gets a chunk of what the budget has left (chunked prefill; without it a prompt runs whole, and the budget is at least
max_model_len). Then waiting requests are admitted first-come first-served while rows, budget and blocks
last, each starting after its longest cached prefix. When the blocks for a running request's tokens cannot be
found, the most recently admitted request is preempted: its blocks are freed and it waits again at the front of
the queue, to be recomputed (prompt and what it generated) when it is admitted again.

Scheduling runs ahead of the device by a step when the engine overlaps them: a request's `computed` advances when
its piece is scheduled, and its `pending` tokens (sampled by steps in flight, not read back yet) count as its own,
so a decoding request is scheduled again before its last token is known (the device feeds that token itself). One
whose pending tokens surely end it (max_tokens, max_model_len) is not scheduled again; one that turns out to have
stopped (EOS, a stop string) wastes that row of the step, and its extra token is dropped.

A speculating request's decode step (`Request.draft` = k) writes k + 1 positions and counts k + 1 tokens of the
budget; its `computed` advances by one when scheduled, and by the accepted drafts when the engine reads them.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.kv_pool import KVPool, OutOfBlocks
from serving.request import Request


@dataclass
class Batch:
    pieces: list  # (request, start, n): tokens start .. start+n-1 of request.tokens run this step
    preempted: list = field(default_factory=list)
    admitted: list = field(default_factory=list)  # requests that took a row this step


class Scheduler:
    def __init__(self, pool: KVPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 chunked_prefill: bool = True, lookahead: int = 0):
        self.pool, self.max_num_seqs, self.chunked = pool, max_num_seqs, chunked_prefill
        self.max_model_len = max_model_len
        # without chunks a whole prompt must fit a step's budget (as vLLM requires), or long ones would starve
        self.budget = max_num_batched_tokens if chunked_prefill else max(max_num_batched_tokens, max_model_len)
        # A chunk longer than a ring would write over its own earlier blocks before they are cached: with prefix
        # caching, chunks stay short enough that every full block of a ring reaches the cache (S - bs + 1).
        rings = [g.slots for g in pool.groups if g.ring] if pool.prefix_caching and chunked_prefill else []
        self.max_chunk = min(rings) - pool.block_size + 1 if rings else None
        self.lookahead = lookahead  # the most draft tokens a request's step verifies (its ring slots to spare)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _size(self, req: Request, budget: int) -> int:
        if req.pending and self.surely_done(req):
            return 0
        need = len(req.tokens) + req.pending - req.computed
        if not self.chunked:
            return need if need <= budget else 0
        n = min(need, budget, self.max_chunk or need)
        end = req.computed + n
        for a, b in req.spans:  # an image whose tokens attend to each other runs within one chunk
            if a < end < b:
                return max(a - req.computed, 0)
        return n

    def _cost(self, req: Request, n: int) -> int:
        """Positions (and budget tokens) a piece of n tokens takes: a speculating decode step writes its drafts
        too (the last known token and k drafts)."""
        return 1 + min(req.draft, self.lookahead) if req.verifies(req.computed, n) else n

    def _allocate(self, req: Request, cost: int) -> None:
        self.pool.allocate(req.blocks, req.computed, min(req.computed + cost, self.max_model_len))

    def surely_done(self, req: Request) -> bool:
        """Its pending tokens reach max_tokens or max_model_len, whatever they are."""
        limit = req.params.max_tokens or self.max_model_len
        return len(req.output) + req.pending >= limit or len(req.tokens) + req.pending >= self.max_model_len

    def schedule(self) -> Batch:
        batch = Batch([])
        for req in self.running:  # publish the blocks the device has been asked to write, whose tokens are known
            self.pool.register(req.blocks, req.tokens, req.computed)
        budget = self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._size(req, budget)
            cost = self._cost(req, n)
            if n == 0 or cost > budget:
                i += 1
                continue
            try:
                self._allocate(req, cost)
            except OutOfBlocks:
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
                continue
            batch.pieces.append((req, req.computed, n))
            req.computed += n
            budget -= cost
            i += 1
        while self.waiting and not batch.preempted and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            assert not req.pending, "a preempted request waits until its tokens in flight are read back"
            row = self.free_rows[-1]
            req.blocks = self.pool.new(req.salt, req.digests, row if len(self.pool.table) else None)
            req.computed = req.cached = self.pool.reuse(req.blocks, req.tokens)
            n = self._size(req, budget)
            cost = self._cost(req, n)
            try:
                if n == 0 or cost > budget:
                    raise OutOfBlocks("budget")
                self._allocate(req, cost)
            except OutOfBlocks:  # undone without a trace: it tries again next step, its digests kept
                self.pool.release(req.blocks, touch=False)
                req.blocks, req.computed, req.cached = None, 0, 0
                break
            self.pool.count(req.blocks)
            self.waiting.popleft()
            req.row = self.free_rows.pop()
            self.running.append(req)
            batch.admitted.append(req)
            batch.pieces.append((req, req.computed, n))
            req.computed += n
            budget -= cost
        return batch

    def _preempt(self, req: Request, batch: Batch) -> None:
        self.running.remove(req)
        self._free(req)
        req.computed = 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def _free(self, req: Request) -> None:
        if req.blocks is not None:
            self.pool.release(req.blocks)
            req.blocks = None
        if req.row >= 0:
            self.free_rows.append(req.row)
            req.row = -1

    def finish(self, req: Request) -> None:
        """A running or waiting request is done (finished or aborted): free everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
