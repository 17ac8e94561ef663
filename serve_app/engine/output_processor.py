"""OutputProcessor: one request's core outputs (token ids, each with its part) made the deltas its caller reads --
detokenized, its reasoning apart from its answer, held to its stop strings (none under `min_tokens`), its logprobs
given their text. It runs outside the engine core, where the client reads the stream (`DeltaStream`); when a stop
string ends the request first, the client aborts it in the core and drops what the core still sends."""

from __future__ import annotations

from dataclasses import replace

from serve_app.engine.stop_strings import StopStringMatcher
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.outputs import CoreOutput, FinishReason, SampledLogprob, StreamDelta, TokenLogprob, TokenRole, Usage
from serve_app.wire.requests import EncodedRequest, GenerateRequest

# Tool-call formats whose markers are their models' special tokens (Mistral's [TOOL_CALLS], DeepSeek's
# <｜tool▁call▁begin｜>, gpt-oss's <|channel|>): their answers keep special tokens in their text, or the calls could
# not be read (as vLLM does).
_MARKED_BY_SPECIAL_TOKENS = frozenset({"mistral", "deepseek_v31", "openai"})


def skips_special_tokens(request: GenerateRequest) -> bool:
    """Whether the request's text leaves special tokens out: as it asks, unless its tool calls are marked by them."""
    spec = request.structured_output
    marked = spec is not None and spec.tool_calls is not None and spec.tool_calls.format in _MARKED_BY_SPECIAL_TOKENS
    return request.skip_special_tokens and not marked


class OutputProcessor:
    """Makes one request's deltas of its core outputs, in order, until the request ends (by the core or by a stop
    string or a failure, `ended_here`); outputs after the end are dropped (None)."""

    def __init__(self, tokenizer: Tokenizer, request: EncodedRequest) -> None:
        asked = request.request
        self._decode = tokenizer.decode
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids, skips_special_tokens(asked))
        self._stops = StopStringMatcher(asked.stop, asked.include_stop_str_in_output)
        self._min_tokens = asked.min_tokens
        self._tokens = 0  # output tokens read so far
        self._text_role: TokenRole = "answer"  # the part the text the detokenizer may hold belongs to
        self._usage: Usage | None = None  # the latest the core sent
        self.ended = False
        self.ended_here = False  # a stop string ended it before the core did: abort it there

    def process(self, output: CoreOutput) -> StreamDelta | None:
        """The delta `output` makes; None once the request has ended."""
        if self.ended:
            return None
        if output.usage is not None:
            self._usage = output.usage
        text, reasoning = [], []
        for index, (token, role) in enumerate(zip(output.token_ids, output.roles)):
            self._tokens += 1
            if role == "end":
                continue
            if role == "tag":  # a marker: what was held goes to the part it was written in
                held, side = self._detokenizer.skip(token), self._text_role
            else:
                held, side = self._detokenizer.push(token), role
                self._text_role = role
            if side == "thinking":
                reasoning.append(held)
                continue
            stops = self._stops
            text.append(stops.pass_through(held) if self._tokens < self._min_tokens else stops.feed(held))
            if stops.matched is not None:  # ends here: the rest of the output is not the request's
                self.ended, self.ended_here = True, output.finish_reason is None
                return self._delta(output, index + 1, "".join(text), "".join(reasoning), "stop", stops.matched)
        reason = output.finish_reason
        if reason is None:
            return self._delta(output, len(output.token_ids), "".join(text), "".join(reasoning))
        self.ended = True
        if reason not in ("stop", "length"):  # cancelled or failed: what is held was never whole
            return self._delta(output, len(output.token_ids), "".join(text), "".join(reasoning), reason)
        held = self._detokenizer.flush()
        stops = self._stops
        if self._text_role == "thinking":
            return self._delta(output, len(output.token_ids), "".join(text) + stops.flush(), "".join(reasoning) + held, reason)
        text.append(stops.feed(held))
        if stops.matched is not None:
            return self._delta(output, len(output.token_ids), "".join(text), "".join(reasoning), "stop", stops.matched)
        return self._delta(output, len(output.token_ids), "".join(text) + stops.flush(), "".join(reasoning), reason)

    def failed(self, output: CoreOutput, error: str) -> StreamDelta:
        """The last delta of a request whose text could not be made of `output`: it ends here (and is aborted in the
        core, unless `output` ended it there)."""
        self.ended, self.ended_here = True, output.finish_reason is None
        usage = replace(self._usage, completion_tokens=self._tokens) if self._usage is not None else None
        return StreamDelta("", (), "error", usage=usage, error=error)

    def _delta(
        self,
        output: CoreOutput,
        count: int,
        text: str,
        reasoning: str,
        reason: FinishReason | None = None,
        stop_string: str | None = None,
    ) -> StreamDelta:
        """The delta of the first `count` tokens of `output` (all of them unless a stop string cut it)."""
        usage = output.usage
        if reason is not None and self._usage is not None:  # the last: the tokens this request kept
            usage = replace(self._usage, completion_tokens=self._tokens)
        return StreamDelta(
            text,
            output.token_ids[:count],
            reason,
            tuple(self._logprob(lp) for lp in output.logprobs[:count]),
            stop_string,
            usage,
            output.error,
            output.queue_time_s,
            reasoning,
            output.embedding,
        )

    def _logprob(self, sampled: SampledLogprob) -> TokenLogprob:
        decode = self._decode
        top = tuple((token, decode([token]), value) for token, value in sampled.top)
        return TokenLogprob(sampled.token_id, decode([sampled.token_id]), sampled.logprob, top)
