"""The model's tokenizer and chat template, behind one small class the engine and protocols share (loaded from
transformers' tokenizer exported once, so the processes that only tokenize never import torch)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_app.config import default_cache_dir
from serve_app.model.tokenizer_export import load_tokenizer_export
from serve_app.wire.model_card import ToolFormat
from serve_app.wire.refusals import InvalidRequestError

if TYPE_CHECKING:
    from serve_app.wire.requests import GenerateRequest

ChatMessage = dict[str, Any]

# DeepSeek-V3.1's call in its template: the tool's name right after the call's token (V3 and R1 write its type there).
_DEEPSEEK_V31_CALL = re.compile(r"<｜tool▁call▁begin｜>'\s*\+\s*tool\['function'\]\['name'\]")

# Fill-in-the-middle tokens (prefix, suffix, middle) by family: StarCoder and SantaCoder, then Qwen2.5-Coder and Qwen3.
FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def template_tool_format(template: str) -> ToolFormat:
    """The tool-call format a chat template speaks: `mistral` (`[TOOL_CALLS]name[ARGS]`: Mistral Small 3.2,
    Devstral, Magistral), `qwen3_coder` (Qwen3-Coder's XML), `deepseek_v31` (DeepSeek-V3.1, whose template takes
    no `tools`: the format describes them), `hermes` (`<tool_call>` tags: Qwen2.5, Qwen3, Hermes, SmolLM3),
    `llama3_json` (Llama 3.1+), `openai` (gpt-oss's harmony channels: a call is a message ending `<|call|>`), or
    `generic` for a template that ignores tools."""
    if "<|channel|>" in template and "<|call|>" in template:
        return "openai"
    if _DEEPSEEK_V31_CALL.search(template):
        return "deepseek_v31"
    if "tools" not in template:
        return "generic"
    if "[TOOL_CALLS]" in template and "[ARGS]" in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template and '"parameters"' in template:
        return "llama3_json"
    return "generic"


class Tokenizer:
    """A model's tokenizer as transformers makes it (read from its export, without torch): plain encoding, the chat
    template, decoding, end-of-sequence ids."""

    def __init__(self, path: Path, extra_eos_token_ids: Sequence[int] = (), cache_dir: Path | None = None) -> None:
        from tokenizers import Tokenizer as Backend

        self.path = path
        export = load_tokenizer_export(path, default_cache_dir() if cache_dir is None else cache_dir)
        self._backend = Backend.from_str(export["backend"])
        self.chat_template: str | dict[str, str] | None = export["chat_template"]
        self._special_tokens = export["special_tokens"]
        self._clean_up_spaces = export["clean_up_spaces"]
        eos = {int(i) for i in extra_eos_token_ids}
        if export["eos_token_id"] is not None:
            eos.add(export["eos_token_id"])
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = export["length"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of a string (with the tokenizer's own special tokens, where asked: as the engine encodes a
        string prompt)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_strings(self, ids: Sequence[int]) -> list[str | None]:
        """Each id's token as the vocabulary writes it (None for an id outside it)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary, written as the vocabulary writes it."""
        return self._backend.token_to_id(token)

    def transformers_tokenizer(self) -> Any:
        """transformers' own tokenizer for this model (importing torch), for libraries that read one: xgrammar."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @property
    def tool_format(self) -> ToolFormat:
        template = self.chat_template
        return template_tool_format(template) if isinstance(template, str) else "generic"

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text for `messages` (and `tools`, OpenAI's function-tool shape, where it takes them), with
        `template_kwargs` as the template's further variables (vLLM's `chat_template_kwargs`: `enable_thinking`),
        rendered as transformers' `apply_chat_template` renders it."""
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

        template = self._template_for(tools)
        if not messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        try:
            rendered, _ = render_jinja_template(
                conversations=[_normalize_chat_messages(list(messages))], tools=tools, chat_template=template,
                add_generation_prompt=add_generation_prompt, **{**self._special_tokens, **(template_kwargs or {})},
            )
        except TemplateError as error:
            raise InvalidRequestError("messages", f"the model's chat template refuses them: {error}") from None
        return rendered[0]

    def _template_for(self, tools: list[dict] | None) -> str:
        """The chat template to render with: the model's one, or of its named ones `tool_use` where tools are given
        and it has one, else `default` (as transformers chooses)."""
        template = self.chat_template
        if isinstance(template, dict):
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            template = template.get(name)
        if not template:
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
        return template

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Chat messages -> prompt ids through the template (which already holds the special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def fill_in_the_middle(self, prefix: str, suffix: str) -> str:
        """A prompt asking for the text between `prefix` and `suffix`, in the model's FIM tokens (prefix, suffix,
        middle order, as StarCoder and Qwen-Coder are trained)."""
        for tokens in FIM_TOKENS:
            if all(self.token_id(token) is not None for token in tokens):
                fim_prefix, fim_suffix, fim_middle = tokens
                return f"{fim_prefix}{prefix}{fim_suffix}{suffix}{fim_middle}"
        raise InvalidRequestError("suffix", "this model has no fill-in-the-middle tokens, so it cannot insert text")

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The ids fed for a request's input: chat through the template, text encoded (around a suffix, in the
        model's fill-in-the-middle form), ids as they are."""
        prompt = request.prompt
        if request.messages is not None:
            return self.encode_chat(request.messages, tools=request.tools, template_kwargs=request.chat_template_kwargs)
        if isinstance(prompt, str):
            ids = self.encode(prompt if request.suffix is None else self.fill_in_the_middle(prompt, request.suffix))
            if not ids:
                raise InvalidRequestError("prompt", "encodes to no tokens")
            return ids
        return list(prompt or [])

    def cached_prefix_length(self, request: GenerateRequest, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of `prompt_ids` the request's `cache_prefix` keeps: all of them, or those its
        conversation up to the breakpoint renders to (where that render runs on past the prompt's, the ids
        they share)."""
        prefix = request.cache_prefix
        if prefix is None:
            return 0
        if prefix.messages is None:
            return len(prompt_ids)
        head = self.encode_chat(prefix.messages, False, request.tools, request.chat_template_kwargs)
        return next((i for i, (a, b) in enumerate(zip(head, prompt_ids)) if a != b), min(len(head), len(prompt_ids)))


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces WordPiece-style decoding leaves before punctuation and
    English contractions."""
    for spaced, joined in _CLEAN_UPS:
        text = text.replace(spaced, joined)
    return text


_CLEAN_UPS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"),
    (" 've", "'ve"), (" 're", "'re"),
)
