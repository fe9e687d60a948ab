"""The demo's multi-turn chat workload: conversations that share a system prompt and grow
turn by turn, visited round-robin in a shuffled order, so that a conversation's earlier
pages have left the device (and the host pool) by the time its next turn arrives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache.validate import is_int


@dataclass(frozen=True)
class Request:
    conversation: int
    turn: int
    tokens: np.ndarray  # int64 token ids: the whole conversation so far (a prefill request)


@dataclass(frozen=True)
class ChatWorkload:
    """conversations x turns requests. Each turn appends a user message and an assistant
    reply of turn_tokens[0]..turn_tokens[1] tokens. Raises ValueError for bad sizes."""

    conversations: int = 6
    turns: int = 4
    system_tokens: int = 40
    turn_tokens: tuple[int, int] = (28, 52)
    vocab: int = 150_000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "vocab"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")
        lo, hi = self.turn_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"turn_tokens must be (lo, hi) with 1 <= lo <= hi, got {self.turn_tokens}")

    @property
    def max_tokens(self) -> int:
        """The longest request: the system prompt plus every turn at its longest."""
        return self.system_tokens + self.turns * self.turn_tokens[1]

    def requests(self) -> list[Request]:
        """Every request in the order the engine serves them."""
        rng = np.random.default_rng(self.seed)
        system = rng.integers(0, self.vocab, self.system_tokens)
        history = [system.copy() for _ in range(self.conversations)]
        out = []
        for turn in range(self.turns):
            for conv in rng.permutation(self.conversations):
                n = int(rng.integers(self.turn_tokens[0], self.turn_tokens[1] + 1))
                history[conv] = np.concatenate([history[conv], rng.integers(0, self.vocab, n)])
                out.append(Request(int(conv), turn, history[conv].copy()))
        return out
