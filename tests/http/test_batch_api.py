"""OpenAI's Batch API served in process, through the official SDK: a file uploaded, a batch run to `completed`,
its results read back and parsed as the SDK's own types; validation, cancellation, limits, and tenants apart."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletion

from serve_app import InferenceEngine
from serve_app.config import ServerConfig
from serve_app.http.tenants import TenantDirectory, load_keys
from tests.inprocess import MODEL, InProcessServer, engine_server

KEYS = {"key-a": {"tenant": "acme"}, "key-b": {"tenant": "globex"}}


@pytest.fixture(scope="module")
def server(engine: InferenceEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    config = ServerConfig(
        batch_files_path=tmp_path_factory.mktemp("batches"), max_batch_file_bytes=64 * 1024,
        max_batch_bytes_per_tenant=256 * 1024, max_batch_lines=50, batch_concurrency=4,
    )
    with engine_server(engine, config, TenantDirectory(load_keys(keys), "test-secret")) as srv:
        yield srv


def client(server: InProcessServer, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def request(custom_id: str, content: str, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, **fields}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(oai: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return oai.files.create(file=("requests.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def until_ended(oai: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := oai.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def results(oai: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    text = oai.files.content(file_id).text if file_id else ""
    return {line["custom_id"]: line for line in map(json.loads, text.splitlines())}


def test_a_batch_runs_from_an_uploaded_file_to_results_the_sdk_parses(server: InProcessServer) -> None:
    oai = client(server)
    lines = [request(f"q{i}", f"Name a colour, number {i}.") for i in range(5)] + [request("bad", "hi", temprature=0)]
    file_id = upload(oai, lines)
    assert oai.files.retrieve(file_id).purpose == "batch"
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "colours"})
    assert batch.status == "validating" and batch.metadata == {"job": "colours"}
    batch = until_ended(oai, batch.id)
    assert batch.status == "completed" and batch.model == MODEL
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 5, 1)
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    done = results(oai, batch.output_file_id)
    assert sorted(done) == [f"q{i}" for i in range(5)]
    answers = [ChatCompletion.model_validate(done[f"q{i}"]["response"]["body"]) for i in range(5)]
    assert all(answer.choices[0].message.content for answer in answers)
    assert batch.usage.output_tokens == sum(answer.usage.completion_tokens for answer in answers)
    failed = results(oai, batch.error_file_id)["bad"]["response"]
    assert failed["status_code"] == 400 and failed["body"]["error"]["param"] == "temprature"
    assert batch.id in [listed.id for listed in oai.batches.list()]
    assert oai.files.delete(file_id).deleted and file_id not in [f.id for f in oai.files.list(purpose="batch")]


def test_a_file_that_is_not_a_batch_fails_validation_with_its_lines_errors(server: InProcessServer) -> None:
    oai = client(server)
    wrong_url = {**request("b", "hi"), "url": "/v1/completions"}
    file_id = upload(oai, [request("a", "hi"), request("a", "again"), wrong_url, "{not json"])
    batch = until_ended(oai, oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 2), ("mismatched_url", 3), ("invalid_json", 4)]


def test_a_cancelled_batch_stops_and_keeps_what_it_answered(server: InProcessServer, engine: InferenceEngine) -> None:
    oai = client(server)
    file_id = upload(oai, [request(f"q{i}", f"Count from one to a hundred, run {i}.", max_tokens=200) for i in range(30)])
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (running := oai.batches.retrieve(batch.id)).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for used in (file_id, running.output_file_id, running.error_file_id):  # a running batch's files stay
        with pytest.raises(openai.BadRequestError, match="cancel it"):
            oai.files.delete(used)
    assert oai.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = until_ended(oai, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed < 30
    assert len(results(oai, batch.output_file_id)) == batch.request_counts.completed
    assert oai.files.delete(batch.output_file_id).deleted  # ended: its files may go
    with pytest.raises(openai.BadRequestError):
        oai.batches.cancel(until_ended(oai, oai.batches.create(
            input_file_id=upload(oai, [request("x", "hi")]), endpoint="/v1/chat/completions", completion_window="24h").id).id)


def test_tenants_never_see_each_others_files_or_batches(server: InProcessServer) -> None:
    acme, globex = client(server, "key-a"), client(server, "key-b")
    file_id = upload(acme, [request("a", "hi")])
    batch = acme.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: globex.files.retrieve(file_id), lambda: globex.files.content(file_id),
                 lambda: globex.files.delete(file_id), lambda: globex.batches.retrieve(batch.id),
                 lambda: globex.batches.cancel(batch.id),
                 lambda: globex.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in globex.files.list()] and batch.id not in [b.id for b in globex.batches.list()]
    assert until_ended(acme, batch.id).status == "completed"
    with pytest.raises(openai.AuthenticationError):
        client(server, "no-such-key").files.list()


def test_one_tenants_long_batch_does_not_hold_back_anothers(server: InProcessServer) -> None:
    acme, globex = client(server, "key-a"), client(server, "key-b")
    long_lines = [request(f"q{i}", f"Count from one to fifty, run {i}.", max_tokens=48, ignore_eos=True) for i in range(24)]
    long = acme.batches.create(input_file_id=upload(acme, long_lines), endpoint="/v1/chat/completions",
                               completion_window="24h")
    deadline = time.monotonic() + 60
    while acme.batches.retrieve(long.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    short = globex.batches.create(input_file_id=upload(globex, [request("a", "Hi."), request("b", "Hello.")]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert until_ended(globex, short.id).status == "completed"
    assert acme.batches.retrieve(long.id).status == "in_progress"  # the short batch took its turns beside it
    acme.batches.cancel(long.id)
    assert until_ended(acme, long.id).status == "cancelled"


def test_uploads_and_batches_are_bounded_and_their_fields_checked(server: InProcessServer) -> None:
    oai = client(server)
    with pytest.raises(openai.APIStatusError) as too_big:
        oai.files.create(file=("big.jsonl", io.BytesIO(b"x" * 200 * 1024)), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oai.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    file_id = upload(oai, [request(f"q{i}", "hi") for i in range(51)])  # over max_batch_lines
    batch = until_ended(oai, oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].code == "too_many_requests"
    for fields, param in (({"endpoint": "/v1/moderations"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                          ({"output_expires_after": {"anchor": "created_at", "seconds": 3600}}, "output_expires_after")):
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
        answer = httpx.post(f"{server.url}/v1/batches", json=body, headers={"Authorization": "Bearer key-a"})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    cross_site = httpx.post(f"{server.url}/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"},
                            headers={"Authorization": "Bearer key-a", "Origin": "https://elsewhere.example"})
    assert cross_site.status_code == 403
    for _ in range(3):  # the tenant's bytes: 256 KiB in all
        upload(oai, ["x" * 60_000])
    with pytest.raises(openai.APIStatusError) as full:
        upload(oai, ["x" * 60_000])
    assert full.value.status_code == 413 and "max_batch_bytes_per_tenant" in full.value.message
