"""The scale-out simulation's workload: multi-turn sessions over a few dozen system prompts.

Runs in the benchmark's own process. A session picks one of ``num_system_prompts`` system
prompts (popularity falls off as 1/rank, as a service's few assistants are not used alike) and
talks for a few turns: each turn's prompt is the system prompt, every earlier turn (the user's
message and the reply the engine produced) and a new user message, the way a chat client resends
the whole conversation. So two sessions share their system prompt's blocks, and a session's
next turn shares everything it sent and received before: what a prefix-aware router can keep on
one engine. Sessions start as a Poisson process; a turn is sent a think time after the previous
one's reply ended, so the next prompt holds the tokens the engine really produced.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadConfig:
    # Sizes of a chat service: a few dozen assistants' system prompts; conversations of a few
    # turns whose history (messages and replies of a few hundred tokens) soon outgrows them.
    num_system_prompts: int = 32
    system_prompt_tokens: tuple[int, int] = (128, 1024)
    turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (32, 384)
    output_tokens: tuple[int, int] = (32, 256)
    think_time_s: float = 2.0
    # A conversation ends before a turn that would not fit the model's context (the bench
    # model's 4096 positions).
    max_context_tokens: int = 4096
    vocab_size: int = 8192  # the bench model's
    seed: int = 0


@dataclass
class Session:
    session_id: int
    start_s: float
    system_prompt: list[int]
    # Per turn: the user's message and how many tokens the reply may have.
    user_messages: list[list[int]]
    max_tokens: list[int]
    max_context_tokens: int
    # What the conversation holds so far (prompt of the last turn sent, plus its reply).
    history: list[int] = field(default_factory=list)
    turn: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)

    def next_prompt(self) -> list[int]:
        """The next turn's prompt: the whole conversation so far and the next user message."""
        if not self.history:
            self.history = list(self.system_prompt)
        self.history += self.user_messages[self.turn]
        return list(self.history)

    def replied(self, output_token_ids: list[int]) -> bool:
        """The current turn's reply came back; True if the session has another turn."""
        self.history += output_token_ids
        self.turn += 1
        if self.turn >= self.num_turns:
            return False
        needed = len(self.user_messages[self.turn]) + self.max_tokens[self.turn]
        return len(self.history) + needed < self.max_context_tokens


class Workload:
    """Draws sessions: their start times (Poisson at ``rate`` sessions/s) and their contents."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        low, high = config.system_prompt_tokens
        self.system_prompts = [
            self._tokens(self._rng.randint(low, high)) for _ in range(config.num_system_prompts)
        ]
        self._popularity = [1.0 / (rank + 1) for rank in range(config.num_system_prompts)]

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self.config.vocab_size) for _ in range(n)]

    def sessions(
        self, rate: float, duration_s: float, max_sessions: int | None = None
    ) -> list[Session]:
        """Every session that starts within ``duration_s`` at ``rate`` sessions per second (at
        most ``max_sessions``)."""
        config, rng = self.config, self._rng
        sessions: list[Session] = []
        now = rng.expovariate(rate)
        while now < duration_s and (max_sessions is None or len(sessions) < max_sessions):
            num_turns = rng.randint(*config.turns)
            system = rng.choices(self.system_prompts, weights=self._popularity)[0]
            sessions.append(
                Session(
                    session_id=len(sessions),
                    start_s=now,
                    system_prompt=system,
                    user_messages=[
                        self._tokens(rng.randint(*config.user_tokens)) for _ in range(num_turns)
                    ],
                    max_tokens=[rng.randint(*config.output_tokens) for _ in range(num_turns)],
                    max_context_tokens=config.max_context_tokens,
                )
            )
            now += rng.expovariate(rate)
        return sessions

    def think_time(self) -> float:
        return self._rng.expovariate(1.0 / self.config.think_time_s)

    def mean_output_tokens_per_session(self, num_sessions: int = 2000) -> float:
        """Output tokens a session asks for in all (the context limit cuts some short); draws
        from this workload's generator, so call it on a workload of its own."""
        sessions = self.sessions(rate=1.0, duration_s=float(num_sessions))
        total = 0
        for session in sessions:
            while True:
                session.next_prompt()
                num_tokens = session.max_tokens[session.turn]
                total += num_tokens
                if not session.replied([0] * num_tokens):
                    break
        return total / max(len(sessions), 1)
