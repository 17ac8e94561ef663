"""TaskIntake: a request checked and made a scheduler task, off the scheduler thread: its lengths against the
context and the cache, its token ids against the vocabulary, its priority against the policy, its grammar compiled,
its guard and thinking reader, its sampling generator, its adapter slot and its prompt-caching pin. Also which
reasoning parser an engine has, and its markers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.harmony import HarmonyMarkers
from serve_app.engine.output_processor import skips_special_tokens
from serve_app.engine.reasoning import ReasoningMarkers, ThinkingReader, ThinkingTags
from serve_app.engine.task import AdapterHold, CachePin, Task, TaskAdmission, TaskSampling
from serve_app.engine.task_output import OutputSink, TaskOutput
from serve_app.kv.base import KVCache
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.model.runner import ModelRunner
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.model_card import ReasoningParser, ToolFormat
from serve_app.wire.refusals import InvalidRequestError
from serve_app.wire.requests import EncodedRequest, GenerateRequest, token_id_outside


def reasoning_parser(asked: ReasoningParser | None, tool_format: ToolFormat) -> ReasoningParser | None:
    """The engine's reasoning parser: the one asked for; a harmony model's channels (tool format `openai`) are read
    unless another is asked, which such a model cannot have."""
    if tool_format != "openai":
        if asked == "openai_gptoss":
            raise ValueError("reasoning_parser openai_gptoss reads gpt-oss's channels: its tool_call_format is openai")
        return asked
    if asked not in (None, "openai_gptoss"):
        raise ValueError(f"reasoning_parser {asked}: a harmony model (tool_call_format openai) answers in channels")
    return "openai_gptoss"


def reasoning_markers(parser: ReasoningParser | None, tokenizer: Tokenizer) -> ReasoningMarkers | None:
    if parser is None:
        return None
    return HarmonyMarkers.of(tokenizer) if parser == "openai_gptoss" else ThinkingTags.of(parser, tokenizer)


class TaskIntake:
    """Makes tasks of requests for one engine: its model, cache, grammars and reasoning markers."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: KVCache,
        grammars: GrammarCompiler,
        markers: ReasoningMarkers | None,
        scheduling_policy: str,
    ) -> None:
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.cache = cache
        self.grammars = grammars
        self.markers = markers
        self.scheduling_policy = scheduling_policy
        self.max_model_len = runner.max_model_len

    def task(self, encoded: EncodedRequest, task_id: int, out: OutputSink, withdrawn: Callable[[], bool]) -> Task:
        """`encoded` as task `task_id`, its outputs to go to `out`. Raises InvalidRequestError for a request the
        engine will not run, EngineOverloadedError when too many wait for a compile, and CompileAbandoned when
        `withdrawn()` turns true while its grammar compiles."""
        request, prompt_ids = encoded.request, encoded.prompt_ids
        if request.embed:
            self._check_embeddable(request, prompt_ids)
        max_tokens = 1 if request.embed else self._check_lengths(prompt_ids, request.max_tokens)
        params = request.sampling
        outside = token_id_outside(request, prompt_ids, self.runner.vocab_size)
        if outside is not None:
            raise InvalidRequestError(*outside)
        if request.priority and self.scheduling_policy != "priority":
            raise InvalidRequestError("priority", "this engine schedules first come, first served (scheduling_policy: fcfs)")
        # Compiling a grammar takes milliseconds to a second: here, never on the scheduler thread.
        spec = request.structured_output
        analysis = request.thinking_token_budget != 0  # a harmony grammar without thinking has no analysis channel
        matcher = self.grammars.matcher(spec, withdrawn, analysis) if spec is not None else None
        guard = self.grammars.guard(
            request, lambda: IncrementalDetokenizer(self.tokenizer, prompt_ids, skips_special_tokens(request))
        )
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        thinking = self._thinking(request, prompt_ids)
        if thinking is not None and params.allowed_token_ids is not None:  # the model's markers stay choosable
            markers = self.markers.token_ids  # type: ignore[union-attr]
            params = params.model_copy(update={"allowed_token_ids": [*params.allowed_token_ids, *markers]})
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        prefix = request.cache_prefix
        pin = CachePin(encoded.pin_tokens, prefix.ttl_s) if prefix is not None and encoded.pin_tokens else None
        sampling = TaskSampling(params, frozenset(stop_ids), request.min_tokens, generator, matcher, request.logprobs)
        output = TaskOutput(out, guard, thinking, request.embed)
        admission = TaskAdmission(encoded.prefix_salt, request.priority, pin, encoded.background)
        # The adapter's slot is taken last: nothing after it can fail, and the task gives it back when it ends.
        adapter = self._adapter(request.lora)
        return Task(task_id, len(prompt_ids), list(prompt_ids), max_tokens, sampling, output, admission, adapter)

    def _check_embeddable(self, request: GenerateRequest, prompt_ids: list[int]) -> None:
        """An embed request is a prompt that fits the context, with nothing to generate."""
        if request.messages is not None or request.structured_output is not None or request.suffix is not None:
            raise InvalidRequestError("embed", "a prompt's embedding: give a prompt, without messages, a grammar or a suffix")
        limit = min(self.max_model_len, self.cache.max_task_tokens)
        if len(prompt_ids) > limit:
            raise InvalidRequestError("input", f"{len(prompt_ids)} tokens are over the {limit} an embedding can read")

    def _thinking(self, request: GenerateRequest, prompt_ids: list[int]) -> ThinkingReader | None:
        """A chat request's reader of its thinking, where this engine's model reasons (its budget
        `thinking_token_budget`); a plain prompt's output is all text, as the model writes it."""
        markers = self.markers
        if markers is None or request.messages is None:
            if request.thinking_token_budget is not None:
                why = "no reasoning_parser" if markers is None else "a chat request's only"
                raise InvalidRequestError("thinking_token_budget", f"this engine reads no thinking span here ({why})")
            return None
        spec = request.structured_output
        return markers.span(prompt_ids, request.thinking_token_budget, spec is not None and spec.tool_calls is not None)

    def _adapter(self, name: str | None) -> AdapterHold | None:
        """The slot of LoRA adapter `name`, held for one request (None for the base model)."""
        if name is None:
            return None
        adapters = self.runner.adapters
        if adapters is None:
            raise InvalidRequestError("lora", "this engine serves no adapters (set dynamic_lora_loading_path or lora_paths)")
        slot = adapters.acquire(name)
        return AdapterHold(slot, lambda: adapters.release(slot))

    def _check_lengths(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """The request's token budget; the prompt and `max_tokens` must fit the context and the cache."""
        limit = min(self.max_model_len, self.cache.max_task_tokens)
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_ids)} tokens leave no room to generate "
                f"(max_model_len={self.max_model_len}, the cache holds {self.cache.max_task_tokens} tokens per request)",
            )
        room = limit - len(prompt_ids)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise InvalidRequestError(
                "max_tokens",
                f"{max_tokens} new tokens do not fit: the prompt has {len(prompt_ids)} tokens and the context "
                f"holds {limit}, so at most {room} can be generated",
            )
        return max_tokens
