"""The one loop that owns the model: continuous batching for chat completions, whole batches for decisions.

`Scheduler` is the micro-batcher's worker (batching.py) with a step-level engine beside it (`engine`, the
chat engine of serve/engine.py, for the keys whose endpoint is in `engine.kinds`). Each turn of the loop:

1. take what has arrived (block only when nothing runs), and drop the requests whose client has gone;
2. the prompt being prefilled in chunks (if any) runs its next chunk: at most `max_prefill_tokens` positions;
3. the oldest waiting request decides what runs next, in arrival order:
   - a decision: its batch (`run`, one `decision.run`) runs whole, as the micro-batcher runs it;
   - a chat completion: it is admitted with the waiting ones of its key (the same recipe) while the engine
     has room (`max_batch` running rows at most) and the prompts' tokens fit what is left of the turn's
     `max_prefill_tokens`: one prefill over them, their first tokens sent, then they join the running decode
     batch of their recipe. A prompt longer than the budget is prefilled alone in chunks of the budget, one
     per turn (runtime/chunked.py; while it is, only prompts that fit the rest of the budget are admitted), so
     the running rows keep getting a token every turn; a recipe that reads the whole prefill (a token
     reducer, a KV policy) prefills it whole;
4. one decode step of every running batch: every row gets its next token, finished and cancelled rows leave.

So a request that arrives while others decode waits at most one step (plus one prefill) for its first token.
The loop waits for more requests (up to `max_wait_s`, while more are being read) only when nothing is running:
a burst arriving at an idle server is prefilled together; under load nothing waits for anything.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Hashable

from trimvlm.serve.batching import MicroBatcher, ShuttingDown


class Scheduler(MicroBatcher):
    def __init__(
        self,
        run: Callable[[Hashable, list], list],
        engine,
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.01,
        max_prefill_tokens: int = 4096,
    ):
        super().__init__(run, max_batch=max_batch, max_wait_s=max_wait_s)
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.engine = engine
        self.max_prefill_tokens = max_prefill_tokens

    def stats(self) -> dict:
        return super().stats() | self.engine.stats() | {"max_prefill_tokens": self.max_prefill_tokens}

    def _take(self) -> None:
        """Move what has arrived to the waiting list; block for one request when nothing else is to do."""
        if not self._pending and not self.engine.running and not self._closing:
            self._arrived(self._queue.get())
        while True:
            try:
                self._arrived(self._queue.get_nowait())
            except queue.Empty:
                break
        self._pending = deque(self._live(list(self._pending)))

    def _arrived(self, job) -> None:
        if job is None:
            self._closing = True
        else:
            self._pending.append(job)

    def _loop(self) -> None:
        engine = self.engine
        while not self._abort:
            self._take()
            if not self._pending and not engine.running:
                if self._closing:
                    break
                continue
            budget = self.max_prefill_tokens - engine.prefill_chunk(self.max_prefill_tokens)
            if self._pending and budget > 0:
                first = self._pending[0]
                idle = not engine.running
                if first.key[0] not in engine.kinds:
                    self._pending.popleft()
                    batch = self._collect(first, wait=idle)
                    if batch:
                        self._run(batch)
                elif engine.running < self.max_batch and (
                    engine.partial is None or engine.prefill_tokens(first) <= budget
                ):  # one prompt at a time is prefilled in chunks
                    self._pending.popleft()
                    batch = self._collect(
                        first, room=self.max_batch - engine.running, wait=idle,
                        weight=engine.prefill_tokens, budget=budget,
                    )  # fmt: skip
                    if batch:
                        self.sizes[len(batch)] += 1
                        engine.admit(batch, chunk=budget)
            if engine.running:
                engine.step()
        if self._abort:  # the running rows too: nothing more of them is computed
            engine.abort(ShuttingDown("the server is shutting down"))
        self._fail_waiting()
