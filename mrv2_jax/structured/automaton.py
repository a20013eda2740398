"""One constraint compiled into a token-level finite automaton, in the compact tables the device
keeps (sample/automata.py holds the device side).

Per state (V: the model's vocabulary size, W = ceil(V / 32) words):
  allowed          u32[W]  bit t set: token t may come next (EOS ids exactly in final states)
  exception        u32[W]  bit t set: token t leads somewhere other than default_next
  default_next     i32     where most allowed tokens lead (inside a JSON string: the string)
  first_exception  i32     offset of the state's exceptions in exception_next
and exception_next i32[E]: the next state of each exception, in token order, so an exception's
slot is first_exception + the number of exception bits below it (a popcount, no search).
Memory: 8 * W + 8 bytes per state plus 4 per exception (Qwen3's 151,936 tokens: 38 KB per
state; the demo model's 2,048: 520 bytes).

outlines-core builds the index from a regex; states that cannot reach a final state are pruned
(their tokens disallowed), so every state keeps at least one allowed token. A constraint whose
start state cannot reach a final state is rejected.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from mrv2_jax.structured.vocabulary import TokenVocabulary


@dataclass(frozen=True, eq=False)
class TokenAutomaton:
    shared = True  # one copy in the device pool serves every request with this constraint
    start: int
    allowed: np.ndarray  # u32[n, W]
    exception: np.ndarray  # u32[n, W]
    default_next: np.ndarray  # i32[n]
    first_exception: np.ndarray  # i32[n]
    exception_next: np.ndarray  # i32[E]
    final: np.ndarray  # bool[n]

    @property
    def num_states(self) -> int:
        return self.allowed.shape[0]

    @property
    def num_exceptions(self) -> int:
        return self.exception_next.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.allowed, self.exception, self.default_next, self.first_exception,
                                      self.exception_next))

    def is_allowed(self, state: int, token: int) -> bool:
        return bool((self.allowed[state, token >> 5] >> np.uint32(token & 31)) & 1)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """i32[k]: the tokens allowed in `state`, ascending."""
        bits = np.unpackbits(self.allowed[state].view(np.uint8), bitorder="little")
        return np.flatnonzero(bits).astype(np.int32)

    def next_state(self, state: int, token: int) -> int:
        """The state after `token` (which must be allowed in `state`): the tables' own rule."""
        if not self.is_allowed(state, token):
            raise ValueError(f"token {token} is not allowed in state {state}")
        token = int(token)  # a NumPy int32 would overflow in the bit arithmetic below
        word, bit = token >> 5, token & 31
        ex = self.exception[state]
        if not (ex[word] >> np.uint32(bit)) & 1:
            return int(self.default_next[state])
        below = int(np.unpackbits(ex[:word].view(np.uint8)).sum())
        below += bin(int(ex[word]) & ((1 << bit) - 1)).count("1")
        return int(self.exception_next[self.first_exception[state] + below])

    def walk(self, tokens, state: int | None = None) -> int:
        """The state after `tokens` from `state` (default: the start)."""
        state = self.start if state is None else state
        for token in tokens:
            state = self.next_state(state, int(token))
        return state


def compile_automaton(pattern: str, vocab: TokenVocabulary) -> TokenAutomaton:
    """The automaton of regular expression `pattern` over `vocab` (ValueError if outlines-core
    rejects the pattern or no token sequence satisfies it)."""
    from outlines_core import Index, Vocabulary

    if not vocab.eos_token_ids:
        raise ValueError("structured outputs need a model with an EOS token")
    eos = vocab.eos_token_ids[0]
    try:
        index = Index(pattern, Vocabulary(eos, vocab.tokens))
    except Exception as e:  # noqa: BLE001 - outlines-core's errors vary by type; all mean "cannot"
        raise ValueError(f"the constraint cannot be compiled: {e}") from None
    transitions = {s: {t: n for t, n in edges.items() if t != eos} for s, edges in index.get_transitions().items()}
    finals = set(index.get_final_states())
    states = _live_states(index.get_initial_state(), transitions, finals)
    if not states:
        raise ValueError("no output of this tokenizer satisfies the constraint")
    return _tables(states, transitions, finals, vocab)


def _live_states(start: int, transitions: dict, finals: set) -> list[int]:
    """The states reachable from `start` that can reach a final state, start first ([] when the
    start cannot)."""
    reachable, queue = {start}, deque([start])
    while queue:
        for n in transitions.get(queue.popleft(), {}).values():
            if n not in reachable:
                reachable.add(n)
                queue.append(n)
    incoming: dict[int, set] = {}
    for s in reachable:
        for n in transitions.get(s, {}).values():
            incoming.setdefault(n, set()).add(s)
    live = {s for s in reachable if s in finals}
    queue = deque(live)
    while queue:
        for p in incoming.get(queue.popleft(), ()):
            if p not in live:
                live.add(p)
                queue.append(p)
    if start not in live:
        return []
    return [start] + sorted(live - {start})


def _tables(states: list[int], transitions: dict, finals: set, vocab: TokenVocabulary) -> TokenAutomaton:
    local = {s: i for i, s in enumerate(states)}
    n, w = len(states), -(-vocab.vocab_size // 32)
    default_next = np.zeros(n, np.int32)
    first_exception = np.zeros(n, np.int32)
    edge_state, edge_token, exc_state, exc_token, exc_next = [], [], [], [], []
    for i, s in enumerate(states):
        edges = {t: local[nxt] for t, nxt in transitions.get(s, {}).items() if nxt in local}
        if s in finals:
            edges.update({e: i for e in vocab.eos_token_ids})
        default = Counter(edges.values()).most_common(1)[0][0]
        default_next[i] = default
        first_exception[i] = len(exc_next)
        for t in sorted(edges):
            if edges[t] != default:
                exc_state.append(i)
                exc_token.append(t)
                exc_next.append(edges[t])
        edge_state += [i] * len(edges)
        edge_token += list(edges)
    return TokenAutomaton(start=0, allowed=_bits(n, w, edge_state, edge_token),
                          exception=_bits(n, w, exc_state, exc_token), default_next=default_next,
                          first_exception=first_exception, exception_next=np.asarray(exc_next, np.int32),
                          final=np.asarray([s in finals for s in states]))


def _bits(n: int, w: int, rows, tokens) -> np.ndarray:
    out = np.zeros((n, w), np.uint32)
    tokens = np.asarray(tokens, np.int64)
    np.bitwise_or.at(out, (np.asarray(rows, np.int64), tokens >> 5), (np.uint32(1) << (tokens & 31)).astype(np.uint32))
    return out
