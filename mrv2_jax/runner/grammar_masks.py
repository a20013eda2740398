"""Grammar constraints on the device: each running grammar request owns one state of the
automaton pool (a state that loops on itself), and before every step that samples for it the
host writes the next token's bitmask, from the request's llguidance matcher
(structured/grammar.py), into that state's `allowed` words. The step then masks and advances
it like any automaton: its compiled programs are unchanged.

The engine feeds each matcher the tokens its request receives (engine/scheduler.py) and, while a
grammar request runs, reads every step's tokens before it schedules the next (no async overlap,
no fused decode), so the matcher is current when `write` runs.

The write is one small dispatch per MASK_ROWS requests, compiled once: at start-up when the
runner compiles eagerly, else at the first grammar step (a planned compile).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from mrv2_jax.runner.compile_guard import planned
from mrv2_jax.sample.automata import AutomatonTables, write_allowed

MASK_ROWS = 8  # states per write dispatch


class GrammarMasks:
    def __init__(self, tables: AutomatonTables, eager: bool):
        # With their shardings: under tensor parallelism the tables are replicated over a mesh.
        self._shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tables)
        self._w = tables.allowed.shape[1]
        self._program = None
        self._where: dict[str, tuple[object, int]] = {}  # req_id -> (its matcher, its global state id)
        # Host time of the last `write` (fill + dispatch) and the masks it wrote: benchmarks read them.
        self.last_write_s, self.last_num_masks = 0.0, 0
        if eager:
            self._compiled()

    def __bool__(self) -> bool:
        return bool(self._where)

    def add(self, req_id: str, matcher, state: int) -> None:
        self._where[req_id] = (matcher, state)

    def release(self, req_id: str) -> None:
        self._where.pop(req_id, None)

    def write(self, tables: AutomatonTables, req_ids) -> AutomatonTables:
        """Each grammar request among `req_ids` (those that sample this step): its bitmask now
        into its state's allowed words."""
        start = time.perf_counter()
        rows = [self._where[r] for r in req_ids if r in self._where]
        for lo in range(0, len(rows), MASK_ROWS):
            part = rows[lo : lo + MASK_ROWS]
            at = np.full(MASK_ROWS, -1, np.int32)
            words = np.zeros((MASK_ROWS, self._w), np.uint32)
            for i, (matcher, state) in enumerate(part):
                matcher.fill(words[i])
                at[i] = state
            tables = self._compiled()(tables, at, words)
        self.last_write_s, self.last_num_masks = time.perf_counter() - start, len(rows)
        return tables

    def _compiled(self):
        if self._program is None:
            with planned():
                self._program = jax.jit(write_allowed, donate_argnums=(0,)).lower(
                    self._shapes, jax.ShapeDtypeStruct((MASK_ROWS,), jnp.int32),
                    jax.ShapeDtypeStruct((MASK_ROWS, self._w), jnp.uint32)).compile()
        return self._program
