"""BatchSummary: what a batch run did -- lines answered, failed, already answered before it, tokens, time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchSummary:
    answered: int = 0  # result lines this run wrote
    failed: int = 0  # of them, errors (a line that could not run, or a request answered with an error status)
    already_answered: int = 0  # lines the results file answered before this run (a resumed run skips them)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def count(self, failed: bool, prompt_tokens: int, completion_tokens: int) -> None:
        self.answered += 1
        self.failed += int(failed)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def text(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        resumed = f", {self.already_answered} answered before" if self.already_answered else ""
        return (
            f"{self.answered} lines answered ({self.failed} failed){resumed} in {self.seconds:.1f} s; "
            f"{self.prompt_tokens} prompt and {self.completion_tokens} completion tokens ({rate:.1f} tok/s)"
        )
