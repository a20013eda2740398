"""Acceptance statistics of speculative decoding, as vLLM reports them.

Counted on the host when a step's tokens arrive (one step late, like the tokens): a row that
carried n drafts and emitted m tokens accepted m - 1 of them, and drafts 1..m-1 count as
accepted at their positions.
"""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_spec_tokens: int
    num_drafts: int = 0  # rows verified (one per request per step with drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_spec_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified row: 1 + accepted drafts (vLLM's "acceptance length")."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of verified rows that accepted the draft at each position."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_position]

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_position))

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": self.per_position_acceptance}
