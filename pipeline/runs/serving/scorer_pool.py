"""Scorers shared by the threads of a scoring server, each used by one request at a time.

MLflow's scoring app calls the model's `predict` from a pool of threads (`asyncio.to_thread`), so requests that arrive
together are scored at once. One `FrameScorer` is not safe for that: its face finder builds its detectors on first use
and keeps the frames it last searched, and BlazeFace's LiteRT interpreter holds one input and one output tensor, so
two requests that reach it at once fail (`RuntimeError`; 10 of 12 such requests did). A pool hands each request a
scorer of its own: with `size` 1 it is a lock around the one scorer; with more, a request that finds every scorer busy
builds another (from the model's files, as the first was) until there are `size`, and after that waits for one to be
free. `make predict`, which scores from one thread, builds no second scorer.

Which size is fastest on 2 cores, measured with `scripts/load_serve.py`, is in docs/use-a-model.md ("Many clients at
once"); `serve.scorers` sets it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from pipeline.models.scoring import FrameScorer


class ScorerPool:
    """Up to `size` scorers of one model: `first`, then as many more from `build` as requests at once need.

    Every scorer in the pool has its face detectors built before any request uses it, and scorers are built one at a
    time: `load_model_file` builds a network on the meta device by patching torch's module class for the whole
    process, so a detector built on another thread meanwhile would come out without weights (`NotImplementedError:
    Cannot copy out of meta tensor`, seen when twelve requests reached a fresh server at once)."""

    def __init__(self, first: FrameScorer, build: Callable[[], FrameScorer], size: int) -> None:
        if size < 1:
            raise ValueError(f"a pool of scorers needs at least one, got {size}")
        self.size, self.build = size, build
        self.building = threading.Lock()
        with self.building:
            first.faces.build()
        self.free: queue.LifoQueue[FrameScorer] = queue.LifoQueue()  # the scorer used last first: its memory is warm
        self.free.put(first)
        self.built = 1

    def grown(self) -> FrameScorer | None:
        """A new scorer, its detectors built, if there are fewer than `size`; None otherwise."""
        with self.building:
            if self.built >= self.size:
                return None
            scorer = self.build()
            scorer.faces.build()
            self.built += 1
            return scorer

    def fill(self) -> None:
        """All `size` scorers built now (a server's start), rather than by the first requests that find all busy."""
        while (scorer := self.grown()) is not None:
            self.free.put(scorer)

    def take(self, wait_s: float) -> FrameScorer:
        """A scorer no other request uses: a free one, a new one while there are fewer than `size`, else the first to
        be given back within `wait_s` seconds (TimeoutError after)."""
        try:
            return self.free.get_nowait()
        except queue.Empty:
            pass
        scorer = self.grown()
        if scorer is not None:
            return scorer
        try:
            return self.free.get(timeout=max(wait_s, 0.0))
        except queue.Empty:
            raise TimeoutError(f"no scorer was free within {wait_s:.3g} s") from None

    def give_back(self, scorer: FrameScorer) -> None:
        """`scorer`, taken with `take`, free for the next request."""
        self.free.put(scorer)
