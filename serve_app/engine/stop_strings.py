"""Stop strings: find them in streamed text and hold back any tail that might begin one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feeds text deltas through; emits only text that cannot be part of a stop string.

    On a match the text before the stop string is returned (with the stop string itself where `include_stop`,
    vLLM's `include_stop_str_in_output`) and the matcher reports the stop.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add text; return what is now safe to emit. After a match, `matched` is set."""
        if not self._stops:
            return text
        buffer = self._held + text
        first = None
        for stop in self._stops:
            index = buffer.find(stop)
            if index != -1 and (first is None or index < first[0]):
                first = (index, stop)
        if first is not None:
            self._held = ""
            self.matched = first[1]
            return buffer[: first[0] + (len(first[1]) if self._include else 0)]
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def pass_through(self, text: str) -> str:
        """Text that may not end the output yet (before `min_tokens`): emitted with what was held, unmatched."""
        return self.flush() + text

    def flush(self) -> str:
        """The held tail, once generation ends without a match."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
