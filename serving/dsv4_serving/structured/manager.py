"""Compiled grammars cached by spec key (bounded LRU), compiled in a small thread pool."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from dsv4_serving.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from dsv4_serving.structured.spec import GrammarSpec


class GrammarManager:
    """One per engine core. Errors are ``GrammarSpecError`` (never cached: they are cheap)."""

    def __init__(
        self, backend: GrammarBackend, capacity: int = 256, compile_threads: int = 1
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.backend = backend
        self.capacity = capacity
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")
        self.hits = 0
        self.misses = 0

    def check(self, spec: GrammarSpec) -> None:
        """Validate without compiling (a prefill for a remote decode: the 400 before any KV moves)."""
        self.backend.check(spec)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = spec.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return grammar
            self.misses += 1
        grammar = self.backend.compile(spec)  # outside the lock: compiles may overlap
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return grammar

    def compile_async(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Compile off the engine loop (the request waits, e.g. while its KV is pulled)."""
        return self._pool.submit(self.compile, spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return self.compile(spec).matcher()

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
