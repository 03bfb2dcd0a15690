"""How long agent episodes take (docs/simulation.md#episode-durations): the model the
simulator and the engine emulator share, so that a benchmark can replay exactly the durations
a simulation assumed.

An episode alternates generation and tool calls for a geometric number of turns (capped): each
turn decodes a uniform number of tokens at a per-sequence decode rate, then waits for a tool
whose latency is log-normal. The defaults are an assumption shaped like a coding agent, not a
measurement; they are calibrated so that (over 200k episodes)

    median ~68 s, mean ~96 s (the seed's "about one minute" and "about 1.5 minutes": its
    generation-capacity bound 64 / 96 s * 3600 ~ 2,400 episodes/hour uses a 96 s mean)
    E[slowest of B] / mean ~ 2.6, 4.3, 5.4 for B = 8, 64, 512

Durations are addressed by index: episode i of a seed is the same number however the stream
is read (one at a time by an emulator in arrival order, or in bulk by the simulator in launch
order), because each block of `BLOCK` episodes has its own generator seeded by (seed, block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 4096
"""Episodes drawn per generator; part of the index -> duration mapping, so never change it."""


@dataclass(frozen=True)
class Episodes:
    """A run of episodes: each one's duration, turns and decoded tokens."""

    durations_s: np.ndarray  # float64, seconds
    turns: np.ndarray  # int64
    tokens: np.ndarray  # int64, decoded tokens over all turns


@dataclass(frozen=True)
class EpisodeModel:
    """Geometric turns x (uniform tokens / decode rate + log-normal tool latency)."""

    turn_p: float = 0.12
    """Success probability of the geometric number of turns (mean 1 / turn_p)."""
    max_turns: int = 40
    """Cap on turns (an agent's turn budget); it bounds the tail the batch maximum sees."""
    tokens_min: int = 50
    tokens_max: int = 300
    """Tokens decoded per turn, uniform in [tokens_min, tokens_max]."""
    decode_tokens_per_s: float = 26.5
    """One sequence's decode rate (an engine batches thousands; each advances a token a step)."""
    tool_log_mu: float = 1.12
    tool_log_sigma: float = 1.0
    """Tool latency after each turn: exp(N(mu, sigma^2)) seconds."""

    def __post_init__(self) -> None:
        if not 0.0 < self.turn_p <= 1.0:
            raise ValueError(f"turn_p must be in (0, 1], got {self.turn_p}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not 1 <= self.tokens_min <= self.tokens_max:
            raise ValueError(
                f"need 1 <= tokens_min <= tokens_max, got {self.tokens_min}, {self.tokens_max}"
            )
        if self.decode_tokens_per_s <= 0.0:
            raise ValueError(f"decode_tokens_per_s must be > 0, got {self.decode_tokens_per_s}")
        if self.tool_log_sigma < 0.0:
            raise ValueError(f"tool_log_sigma must be >= 0, got {self.tool_log_sigma}")

    def _block(self, seed: int, block: int) -> Episodes:
        rng = np.random.default_rng([seed, block])
        turns = np.minimum(rng.geometric(self.turn_p, BLOCK), self.max_turns)
        num_turns = int(turns.sum())
        tokens = rng.integers(self.tokens_min, self.tokens_max + 1, num_turns)
        tool_s = rng.lognormal(self.tool_log_mu, self.tool_log_sigma, num_turns)
        owner = np.repeat(np.arange(BLOCK), turns)
        per_turn_s = tokens / self.decode_tokens_per_s + tool_s
        return Episodes(
            durations_s=np.bincount(owner, weights=per_turn_s, minlength=BLOCK),
            turns=turns.astype(np.int64),
            tokens=np.bincount(owner, weights=tokens, minlength=BLOCK).astype(np.int64),
        )

    def episodes(self, seed: int, start: int, count: int) -> Episodes:
        """Episodes start .. start + count - 1 of `seed`."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        first, last = start // BLOCK, (start + count - 1) // BLOCK if count else start // BLOCK
        blocks = [self._block(seed, b) for b in range(first, last + 1)]
        offset = start - first * BLOCK

        def cut(name: str) -> np.ndarray:
            joined = np.concatenate([getattr(b, name) for b in blocks])
            return joined[offset : offset + count]

        return Episodes(cut("durations_s"), cut("turns"), cut("tokens"))

    def durations(self, seed: int, count: int, start: int = 0) -> np.ndarray:
        """Durations (seconds) of episodes start .. start + count - 1 of `seed`."""
        return self.episodes(seed, start, count).durations_s


class EpisodeStream:
    """Episodes of one seed in index order, one at a time (an emulator's arrivals)."""

    def __init__(self, model: EpisodeModel, seed: int) -> None:
        self.model, self.seed = model, seed
        self.next_index = 0
        self._block_index = -1
        self._block: Episodes | None = None

    def next(self) -> tuple[int, float, int]:
        """(index, duration in seconds, decoded tokens) of the next episode."""
        index = self.next_index
        block, offset = divmod(index, BLOCK)
        if block != self._block_index:
            self._block = self.model._block(self.seed, block)
            self._block_index = block
        assert self._block is not None
        self.next_index += 1
        return index, float(self._block.durations_s[offset]), int(self._block.tokens[offset])
