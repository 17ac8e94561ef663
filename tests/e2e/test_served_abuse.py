"""Through `serve run serve_config.yaml` with HTTP on every interface and no API keys: generation is served, the
KV and admin routes are not, and the shapes that stalled the ingress or Ray's routing are refused at once while the
server keeps serving. (The shipped config listens on 127.0.0.1: there open mode serves every route, as the README's
KV SDK example needs; conftest's `served` runs it.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_app.bench.abuse import SHAPES, problems, run_abuse
from serve_app.bench.servers import ServeRun
from tests.inprocess import openai_client

ENGINE_KWARGS = {"cache_tokens": 4096, "max_model_len": 1024, "compile": False}


@pytest.fixture(scope="module")
def open_app(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Iterator[ServeRun]:
    run = ServeRun(
        tmp_path_factory.mktemp("open-app"), model=str(tiny_llama_path), engine_kwargs=ENGINE_KWARGS, plain=True,
        host="0.0.0.0",
    )
    yield run
    run.stop()


def _chat(run: ServeRun, **extra: object) -> dict:
    return {"model": run.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}


def test_open_mode_off_loopback_serves_generation_only_and_says_so(open_app: ServeRun) -> None:
    reply = openai_client(open_app.url).chat.completions.create(**_chat(open_app))
    assert reply.choices[0].finish_reason in ("stop", "length")
    for method, route, body in (
        ("POST", "/v1/kv/lookup", {"tokens": [1, 2, 3]}), ("GET", "/v1/kv/config", None), ("GET", "/stats", None),
        ("GET", "/metrics", None), ("GET", "/stats/replicas", None),
    ):
        response = httpx.request(method, f"{open_app.url}{route}", json=body, timeout=30)
        assert response.status_code == 403, (route, response.text)
        assert "open_mode_admin" in response.json()["error"]["message"]
    log = open_app.log_tail(200_000)
    assert log.count("serving generation only; the KV and admin routes need API keys") == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_k": 2**70}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": [{"role": "user", "content": "x " * 20_000}]}, "messages"),
    ],
)
def test_a_bad_chat_is_a_quick_400(open_app: ServeRun, body: dict, param: str) -> None:
    started = time.perf_counter()
    response = httpx.post(f"{open_app.url}/v1/chat/completions", json=_chat(open_app, **body), timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize(
    ("prompt", "n", "param"),
    [([1, 2, 2**63], 1, "prompt"), ([[1, 2]] * 500, 16, "prompt"), ([1, 2], 10**9, "n")],
)
def test_a_bad_completion_is_refused_before_routing(open_app: ServeRun, prompt: list, n: int, param: str) -> None:
    started = time.perf_counter()
    body = {"model": open_app.model_id, "prompt": prompt, "n": n, "max_tokens": 2}
    response = httpx.post(f"{open_app.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert time.perf_counter() - started < 2


def test_a_plain_text_post_is_refused_and_the_server_keeps_serving(open_app: ServeRun) -> None:
    """A web page may post `text/plain` to any site without asking first: refused, so it cannot drive the server."""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}]}' % open_app.model_id.encode()
    response = httpx.post(f"{open_app.url}/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert response.status_code == 415
    assert httpx.post(f"{open_app.url}/v1/chat/completions", json=_chat(open_app), timeout=60).status_code == 200


def test_the_abuse_benchmark_meets_its_answers_and_the_victim_loses_nothing(open_app: ServeRun) -> None:
    """`serve-app bench abuse` in small: every attacker request gets its expected answer within 5 s and the victim's
    streams all finish (its latency against its baseline is the benchmark's to report, not a test's)."""
    names = {"enum_2000_schema", "enum_450_schema_distinct", "completions_500_prompts_n16", "token_id_2_63",
             "message_1mb", "embeddings_1000_inputs"}
    rows = run_abuse(open_app.url, open_app.model_id, (None, None), [s for s in SHAPES if s.name in names],
                     seconds=2.0, victims=1, attackers=2, rate=4.0, period_s=0.5, max_tokens=8)
    assert [row["shape"] for row in rows] == ["baseline", *[s.name for s in SHAPES if s.name in names]]
    assert problems(rows, deadline_s=5.0, max_ttft_ratio=float("inf")) == []
    assert all(sum(row["attacker"].values()) > 0 for row in rows[1:])
