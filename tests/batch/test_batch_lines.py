"""A batch's lines: OpenAI's batch file format read and refused line by line, the results file (resumed, a torn
last line dropped), and lines answered as their routes answer them, by the default model in process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from serve_app.batch.answering import BatchAnswerer
from serve_app.batch.file_format import LineError, line_key, prefix_key, read_line, result_key
from serve_app.batch import results_file
from serve_app.batch.results_file import STAGED_SUFFIX, ResultsFile
from serve_app.config import ServerConfig
from serve_app.engine.engine import InferenceEngine
from serve_app.http.engine_client import LocalEngineClient, model_card
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.served_models import ServedModels
from tests.inprocess import MODEL


def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}})


def chat(custom_id: str, text: str, **fields) -> str:
    return line(custom_id, messages=[{"role": "user", "content": text}], **fields)


@pytest.mark.parametrize(
    ("text", "custom_id", "code", "says"),
    [
        ("{not json", None, "invalid_json", "not JSON"),
        ("[1, 2]", None, "invalid_request", "JSON object"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None, "invalid_request", "custom_id"),
        (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}), "a", "invalid_request", "method"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {}}), "a", "invalid_url", "/v1/responses"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}), "a", "invalid_request", "body"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}), "a", "invalid_request", "extra"),
        (line("a", prompt="x", stream=True), "a", "invalid_request", "stream"),
    ],
)
def test_a_line_that_cannot_run_says_why(text: str, custom_id: str | None, code: str, says: str) -> None:
    with pytest.raises(LineError) as refused:
        read_line(text)
    assert (refused.value.custom_id, refused.value.code) == (custom_id, code)
    assert says in refused.value.message


def test_keys_match_lines_to_results_and_prefixes_to_each_other() -> None:
    assert line_key(chat("q1", "hi")) == "q1"
    keyless = "{not json"
    assert line_key(keyless).startswith("batch_req_") and line_key(keyless) == line_key(keyless)
    assert line_key(keyless) != line_key("{not json either")
    assert result_key({"id": "batch_req_1", "custom_id": "q1"}) == "q1"
    assert result_key({"id": line_key(keyless), "custom_id": None}) == line_key(keyless)
    assert result_key(["not", "a", "result"]) is None
    system = {"role": "system", "content": "You answer about rivers."}
    first = line("a", messages=[system, {"role": "user", "content": "Longest?"}])
    second = line("b", messages=[system, {"role": "user", "content": "Widest?"}])
    other = line("c", messages=[{"role": "system", "content": "You answer about lakes."}, {"role": "user", "content": "Longest?"}])
    assert prefix_key(first) == prefix_key(second) != prefix_key(other)
    # a chat of one turn shares nothing worth grouping: its key is its own
    assert prefix_key(chat("d", "Longest?")) == "d" and prefix_key(line("e", "/v1/completions", prompt="x")) == "e"


def result(custom_id: str) -> str:
    return json.dumps({"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": {"status_code": 200}, "error": None})


def test_a_results_file_is_appended_and_resumed_without_its_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out" / "results.jsonl"
    results = ResultsFile(str(path))
    assert results.open() == set()
    results.write([result("a"), result("b")])
    results.close()
    again = ResultsFile(str(path))
    assert again.open() == {"a", "b"}
    again.write([result("c")])
    again.close()
    assert [json.loads(text)["custom_id"] for text in path.read_text().splitlines()] == ["a", "b", "c"]
    path.write_text(path.read_text() + result("d")[:25])  # a run stopped mid-line
    torn = ResultsFile(f"file://{path}")
    assert torn.open() == {"a", "b", "c"}
    torn.write([result("d")])
    torn.close()
    assert [json.loads(text)["custom_id"] for text in path.read_text().splitlines()] == ["a", "b", "c", "d"]
    staged = path.with_name(path.name + STAGED_SUFFIX)
    path.rename(staged)  # a rewrite cut short: the lines aside, the file itself a partial copy
    path.write_text(result("a") + "\n")
    assert ResultsFile(str(path)).open() == {"a", "b", "c", "d"} and not staged.exists()


def test_a_results_file_is_read_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text("".join(result(f"k{i}") + "\n" for i in range(50)) + "\n\n")
    monkeypatch.setattr(results_file, "READ_CHUNK_BYTES", 7)  # lines cut across chunks everywhere
    assert ResultsFile(str(path)).open() == {f"k{i}" for i in range(50)}


@pytest.fixture(scope="module")
def answerer(engine: InferenceEngine) -> BatchAnswerer:
    client = LocalEngineClient(engine, model_card(engine, MODEL, engine.config.grammar))
    return BatchAnswerer(ServedModels({MODEL: client}), RequestLimits.from_config(ServerConfig()))


def answer(answerer: BatchAnswerer, *texts: str) -> list[dict]:
    async def run() -> list:
        return await asyncio.gather(*(answerer.answer(text) for text in texts))

    answered = asyncio.run(run())
    return [dict(json.loads(a.result), failed=a.failed, tokens=(a.prompt_tokens, a.completion_tokens)) for a in answered]


def test_lines_are_answered_as_their_routes_answer(answerer: BatchAnswerer) -> None:
    chat_line, completion, embedding = answer(
        answerer,
        chat("c", "What is the capital of France?", max_tokens=8, temperature=0),
        line("p", "/v1/completions", prompt="Once upon a time", max_tokens=4, temperature=0),
        line("e", "/v1/embeddings", input="hello"),
    )
    assert chat_line["custom_id"] == "c" and chat_line["error"] is None and not chat_line["failed"]
    body = chat_line["response"]["body"]
    assert chat_line["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] and chat_line["response"]["request_id"] == body["id"]
    assert chat_line["tokens"] == (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    assert completion["response"]["body"]["object"] == "text_completion"
    assert completion["tokens"][1] == completion["response"]["body"]["usage"]["completion_tokens"] > 0
    assert embedding["response"]["body"]["data"][0]["object"] == "embedding"


def test_a_line_refused_by_its_route_is_its_error_response_and_the_rest_run(answerer: BatchAnswerer) -> None:
    misspelt, unknown_model, too_many, bad, good = answer(
        answerer,
        chat("t", "hi", temprature=0),
        line("m", messages=[{"role": "user", "content": "hi"}]).replace(MODEL, "gpt-4"),
        chat("k", "hi", top_k=2**70),
        "{not json",
        chat("g", "Say hi.", max_tokens=4),
    )
    assert misspelt["response"]["status_code"] == 400 and misspelt["failed"]
    assert misspelt["response"]["body"]["error"]["param"] == "temprature"
    assert unknown_model["response"]["status_code"] == 404
    assert too_many["response"]["status_code"] == 400 and too_many["response"]["body"]["error"]["param"] == "top_k"
    assert bad["response"] is None and bad["error"]["code"] == "invalid_json" and bad["id"] == line_key("{not json")
    assert good["response"]["status_code"] == 200 and not good["failed"]
