"""The request contract: a field an API does not have is a 400 naming it on every route (or, under
`unknown_fields: warn`, accepted and logged once); text-only content; and the vLLM and OpenAI fields built here
(logit_bias, allowed_token_ids, min_tokens, include_stop_str_in_output, skip_special_tokens, echo, suffix,
priority, request_id, prompt_cache_key), through the official SDKs."""

from __future__ import annotations

import logging

import anthropic
import httpx
import openai
import pytest

from serve_app.config import ServerConfig
from serve_app.engine.engine import InferenceEngine
from tests.inprocess import MODEL, InProcessServer, engine_server, openai_client

CHAT = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "max_tokens": 6}

# One body per route that its API accepts, and where in it a misspelled field goes.
ROUTES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
    ("/v1/messages", {"model": MODEL, "messages": CHAT, "max_tokens": 1}),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": CHAT}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "store": False}),
    ("/v1/embeddings", {"model": MODEL, "input": "Hi"}),
]


def _post(server: InProcessServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _message(response: httpx.Response) -> tuple[str, str | None]:
    """An error's message and param, in either API's shape."""
    error = response.json()["error"]
    return error["message"], error.get("param")


@pytest.mark.parametrize("path,body", ROUTES, ids=[path for path, _ in ROUTES])
def test_a_misspelled_field_is_a_400_naming_it_on_every_route(server: InProcessServer, path: str, body: dict) -> None:
    assert _post(server, path, body).status_code == 200
    refused = _post(server, path, {**body, "temprature": 0.2})
    assert refused.status_code == 400, refused.text
    message, param = _message(refused)
    assert message.startswith("temprature: unrecognized field"), message
    assert param in (None, "temprature")  # Anthropic's error shape has no param


def test_a_nested_unknown_field_is_named_by_its_path(server: InProcessServer) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "colour": 1}]}]}
    refused = _post(server, "/v1/chat/completions", body)
    assert refused.status_code == 400 and _message(refused)[1] == "messages.0.content.0.colour", refused.text
    missing = {**body, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert _message(_post(server, "/v1/chat/completions", missing))[1] == "messages.0.content.0.text"
    tools = {"model": MODEL, "max_tokens": 1, "messages": CHAT, "tools": [{"name": "f", "input_schema": {}, "colour": 1}]}
    refused = _post(server, "/v1/messages", tools)
    assert refused.status_code == 400 and _message(refused)[0].startswith("tools.0.colour: unrecognized field")


def test_fields_of_the_api_not_built_here_are_refused_by_name_and_their_defaults_accepted(server: InProcessServer) -> None:
    base = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    for field, value in [("use_beam_search", True), ("store", True), ("modalities", ["text", "audio"]), ("best_of", 3)]:
        refused = _post(server, "/v1/chat/completions", {**base, field: value})
        assert refused.status_code == 400 and _message(refused)[1] == field, refused.text
    defaults = {"use_beam_search": False, "store": False, "modalities": ["text"], "best_of": 1, "service_tier": "auto"}
    assert _post(server, "/v1/chat/completions", {**base, **defaults}).status_code == 200


def test_images_and_audio_are_refused_as_text_only(server: InProcessServer) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, image]}]}
    refused = _post(server, "/v1/chat/completions", body)
    message, param = _message(refused)
    assert refused.status_code == 400 and param == "messages.0.content" and "text only" in message, refused.text
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    refused = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [block]}]})
    assert refused.status_code == 400 and "text only" in _message(refused)[0], refused.text
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    refused = _post(server, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": [audio]}]})
    assert refused.status_code == 400 and "not audio" in _message(refused)[0]


def test_unknown_fields_warn_accepts_and_logs_each_once(engine: InferenceEngine, caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "vendor_hint": "x"}
    with engine_server(engine, ServerConfig(unknown_fields="warn")) as warned, caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert _post(warned, "/v1/chat/completions", body).status_code == 200
        misspelled = {**body, "temprature": 2.0, "top_k": 1}
        assert _post(warned, "/v1/chat/completions", misspelled).status_code == 200
        refused = _post(warned, "/v1/chat/completions", {**body, "use_beam_search": True})
        assert refused.status_code == 400  # a field of the API not built here is still refused
    logged = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sum("'vendor_hint'" in line for line in logged) == 1 and sum("'temprature'" in line for line in logged) == 1


def _first_token(oai: openai.OpenAI, **fields) -> tuple[int, str]:
    out = oai.completions.create(model=MODEL, prompt="The sky is", extra_body={"return_token_ids": True, **fields}, **GREEDY)
    return out.choices[0].token_ids[0], out.choices[0].text


def test_logit_bias_and_allowed_token_ids_steer_even_greedy_choices(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    top, _ = _first_token(oai)
    pushed = engine.tokenizer.encode(" green")[0]
    assert _first_token(oai, logit_bias={str(pushed): 100})[0] == pushed
    assert _first_token(oai, logit_bias={str(top): -100})[0] != top
    allowed = [engine.tokenizer.encode(word)[0] for word in (" red", " blue")]
    out = oai.completions.create(model=MODEL, prompt="The sky is", extra_body={"allowed_token_ids": allowed, "return_token_ids": True}, **GREEDY)
    assert set(out.choices[0].token_ids) <= set(allowed)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={"99999999": 1}, max_tokens=1)
    assert bad.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={"5": 101}, max_tokens=1)
    assert bad.value.body["param"] == "logit_bias"


def test_min_tokens_holds_off_stop_tokens_and_strings(oai: openai.OpenAI) -> None:
    top, text = _first_token(oai)
    stopped = oai.completions.create(model=MODEL, prompt="The sky is", extra_body={"stop_token_ids": [top]}, **GREEDY)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = oai.completions.create(
        model=MODEL, prompt="The sky is", extra_body={"stop_token_ids": [top], "min_tokens": 3, "return_token_ids": True}, **GREEDY
    )
    assert held.usage.completion_tokens >= 3 and top not in held.choices[0].token_ids[:3]
    word = text.split()[0]
    by_string = oai.completions.create(model=MODEL, prompt="The sky is", stop=[word], extra_body={"min_tokens": 2}, **GREEDY)
    assert by_string.usage.completion_tokens >= 2


def test_include_stop_str_in_output_and_skip_special_tokens(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    _, text = _first_token(oai)
    stop = text.strip()[:3]
    kept = oai.completions.create(model=MODEL, prompt="The sky is", stop=[stop], extra_body={"include_stop_str_in_output": True}, **GREEDY)
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"
    end = next(iter(engine.tokenizer.eos_token_ids))
    special = engine.tokenizer.decode([end], skip_special_tokens=False)
    forced = {"logit_bias": {str(end): 100}, "ignore_eos": True, "max_tokens": 2}
    shown = oai.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body={**forced, "skip_special_tokens": False})
    hidden = oai.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body=forced)
    assert shown.choices[0].text.startswith(special) and special not in hidden.choices[0].text


def test_echo_puts_the_prompt_before_the_answer_streamed_or_not(oai: openai.OpenAI) -> None:
    plain = oai.completions.create(model=MODEL, prompt="The sky is", **GREEDY)
    echoed = oai.completions.create(model=MODEL, prompt="The sky is", echo=True, **GREEDY)
    assert echoed.choices[0].text == "The sky is" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model=MODEL, prompt="The sky is", echo=True, stream=True, **GREEDY))
    assert streamed == echoed.choices[0].text


def test_suffix_needs_fill_in_the_middle_tokens(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="def add(a, b):", suffix="    return c", max_tokens=4)
    assert bad.value.body["param"] == "suffix" and "fill-in-the-middle" in bad.value.body["message"]


def test_priority_needs_the_priority_policy_and_request_id_names_the_answer(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"priority": 1})
    assert bad.value.body["param"] == "priority" and "fcfs" in bad.value.body["message"]
    named = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"request_id": "abc-1", "priority": 0})
    assert named.id == "chatcmpl-abc-1"


def test_prompt_cache_key_is_the_cache_salt(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    long_chat = [{"role": "user", "content": "Tell me about the sea. " * 12}]

    def cached(key: str) -> int:
        out = oai.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1, prompt_cache_key=key)
        return out.usage.prompt_tokens_details.cached_tokens

    cached("key-a")
    assert cached("key-a") > 0 and cached("key-b") == 0
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, prompt_cache_key="a", extra_body={"cache_salt": "b"})
    assert bad.value.body["param"] == "prompt_cache_key"
    first = oai.responses.create(model=MODEL, input=long_chat[0]["content"], max_output_tokens=16, prompt_cache_key="key-c", store=False)
    again = oai.responses.create(model=MODEL, input=long_chat[0]["content"], max_output_tokens=16, prompt_cache_key="key-c", store=False)
    other = oai.responses.create(model=MODEL, input=long_chat[0]["content"], max_output_tokens=16, prompt_cache_key="key-d", store=False)
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens > 0 and other.usage.input_tokens_details.cached_tokens == 0


def test_the_sdks_own_extra_fields_are_accepted(server: InProcessServer) -> None:
    """What the SDKs' helpers send back as history: OpenAI's parsed arguments, Anthropic's tool-use caller."""
    oai = openai_client(server.url)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}", "parsed_arguments": {}}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None}, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    assert oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).choices
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}, "caller": {"type": "direct"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    body = {"model": MODEL, "max_tokens": 1, "messages": [*CHAT, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]}
    assert _post(server, "/v1/messages", body).status_code == 200


def test_anthropic_cache_control_writes_its_prefix_once_and_keeps_it(claude: anthropic.Anthropic, engine: InferenceEngine) -> None:
    system = [{"type": "text", "text": "You tutor geography, rivers above all. " * 8, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": "Name a long river in Asia and one in Africa, please."}]
    pins = len(engine.cache.pool.pins)
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
    first = claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=messages).usage
    assert first.cache_creation_input_tokens > 0 and first.cache_read_input_tokens == 0
    assert first.input_tokens > 0  # the question, after the breakpoint
    assert first.input_tokens + first.cache_creation_input_tokens + first.cache_read_input_tokens == counted
    assert len(engine.cache.pool.pins) == pins + 1
    again = claude.messages.create(model=MODEL, max_tokens=1, system=system, messages=messages).usage
    assert again.cache_creation_input_tokens == 0 and again.cache_read_input_tokens >= first.cache_creation_input_tokens
    whole = claude.messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Which sea is saltiest? " * 6}],
        extra_body={"cache_control": {"type": "ephemeral"}},
    ).usage
    assert whole.input_tokens < engine.cache.page_size <= whole.cache_creation_input_tokens  # the whole prompt, in pages


def test_openai_prompt_cache_retention_keeps_the_prompt(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    pins = len(engine.cache.pool.pins)
    chat = [{"role": "user", "content": "Describe the tides of the Atlantic at length. " * 4}]
    oai.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, extra_body={"prompt_cache_retention": "24h"})
    oai.responses.create(model=MODEL, input="Describe the tides of the Pacific at length. " * 4, max_output_tokens=16,
                         store=False, extra_body={"prompt_cache_retention": "in_memory"})
    assert len(engine.cache.pool.pins) == pins + 2


def test_tokenize_and_detokenize_in_vllms_shapes(server: InProcessServer, engine: InferenceEngine, oai: openai.OpenAI) -> None:
    text = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True}).json()
    assert text["tokens"] == engine.tokenizer.encode("Hello there") and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == engine.max_model_len and "".join(text["token_strs"]).replace("Ġ", " ") == "Hello there"
    chat = _post(server, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    usage = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens and chat["token_strs"] is None  # what the chat route runs
    bare = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]
    back = _post(server, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]}).json()["prompt"]
    assert back == engine.tokenizer.apply_chat_template(CHAT)
    for path, body, param in [
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"prompt": "x", "add_special_token": True}, "add_special_token"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
    ]:
        refused = _post(server, path, body)
        assert refused.status_code in (400, 404) and refused.json()["error"]["param"] == param, refused.text


def test_anthropic_model_list_in_anthropics_shape(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    listed = claude.models.list()
    assert [m.id for m in listed.data] == [m.id for m in oai.models.list().data] and listed.data[0].type == "model"
    assert claude.models.retrieve(MODEL).id == MODEL and claude.models.retrieve(MODEL).created_at.year >= 2024
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("nope")
    with pytest.raises(anthropic.BadRequestError):
        claude.models.list(limit=0)


def test_a_messages_name_reaches_the_chat_template() -> None:
    from serve_app.http.protocols.openai.schema import ChatMessage, chat_prompt
    from serve_app.http.tools import format_for

    messages = [ChatMessage(role="user", content="Hi", name="ann"), ChatMessage(role="user", content="Yo")]
    for tool_format in ("generic", "hermes"):
        rendered = chat_prompt(messages, format_for(tool_format), None).messages
        assert rendered[0]["name"] == "ann" and "name" not in rendered[1]


def test_chat_template_kwargs_reach_the_template(server: InProcessServer, model_path, tmp_path) -> None:
    import shutil

    from serve_app.model.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}\n{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}"
    )
    tokenizer = Tokenizer(tmp_path)
    plain = tokenizer.apply_chat_template(CHAT)
    assert tokenizer.apply_chat_template(CHAT, template_kwargs={"enable_thinking": False}) == plain + "<think></think>"
    for path, body in [
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"tools": []}}),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}),
    ]:
        refused = _post(server, path, body)
        assert refused.status_code == 400 and "chat_template_kwargs" in refused.json()["error"]["message"], refused.text
    accepted = _post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert accepted.status_code == 200  # the embedded model's template ignores it
