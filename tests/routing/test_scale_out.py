"""Two engine replicas behind `serve run` with the settings of `make serve` (Serve's throughput mode,
HAProxy), routed by the pages they cache and the LoRA adapters they hold (deployments.router), and a
second model (a tiny one) in the same app, an engine deployment of its own.

Each replica gets one torch thread, as the replicas share this machine's two cores. With Serve's
default router a conversation's next turn lands on the replica without its history about half
the time; here every later turn (under a LoRA adapter too) and every KV lookup must find its prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from serve_app.bench.servers import ServeRun
from serve_app.kvsdk import KVError, connect, create_request, make_post_completion
from tests.adapters import build_adapter
from tests.browser import needs_chromium
from tests.inprocess import MODEL, anthropic_client, openai_client
from tests.otlp import TraceReceiver
from tests.served import FOLLOWER_IDLE_S, check_routing_across_an_idle_spell, router_config
from tests.tiny_models import build_tiny_model

PAGE = 16
TWO_REPLICAS = {
    "autoscaling_config": {"min_replicas": 2, "max_replicas": 2},
    "ray_actor_options": {"num_cpus": 0},
    # Eight conversations at once on two replicas: the history decides, not a passing imbalance of a few.
    "request_router_config": router_config(balance_abs_threshold=16, idle_after_s=FOLLOWER_IDLE_S),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    folder = tmp_path_factory.mktemp("served-adapters")
    for seed, name in enumerate(("a", "b"), start=1):
        build_adapter(model_path, folder / name, seed)
    return folder


TINY = "tiny-llama"


@pytest.fixture(scope="module")
def traces() -> Iterator[TraceReceiver]:
    receiver = TraceReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def two_engines(
    tmp_path_factory: pytest.TempPathFactory, adapters: Path, model_path: Path, traces: TraceReceiver
) -> Iterator[ServeRun]:
    tiny = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-served"), tokenizer_from=model_path)
    run = ServeRun(
        tmp_path_factory.mktemp("scale-out"),
        models=[
            {"lora_config": {"dynamic_lora_loading_path": str(adapters)}},
            {
                "model_loading_config": {"model_id": TINY, "model_source": str(tiny)},
                "engine_kwargs": {"max_model_len": 1024},
                "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
            },
        ],
        engine_kwargs={"cache_tokens": 4096, "max_model_len": 2048, "num_threads": 1, "compile": False},  # card's app: compiled
        engine_deployment=TWO_REPLICAS,
        args={"otlp_traces_endpoint": traces.url},
    )
    try:
        _until_the_ingress_routes_to_both(run)
        yield run
    finally:
        run.stop()


def _until_the_ingress_routes_to_both(run: ServeRun) -> None:
    """/health answers once one replica is up, and the ingress learns of the second from Serve's controller
    a little after that replica reports to the board: send requests shorter than a page (no prefix to route
    by) until both have taken one."""
    client = openai_client(run.url)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tasks = _replica_tasks(run)
        if len(tasks) == 2 and all(count > 0 for count in tasks.values()):
            return
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        time.sleep(0.2)
    raise AssertionError(f"the ingress did not route to both replicas: {_replica_tasks(run)}")


def _replica_stats(run: ServeRun, model: str = MODEL) -> dict[str, dict]:
    stats = httpx.get(f"{run.url}/stats/replicas", timeout=10).json()
    return {replica: s for replica, s in stats.items() if s["model"] == model}


def _replica_tasks(run: ServeRun) -> dict[str, int]:
    return {replica: s["total_tasks"] for replica, s in _replica_stats(run).items()}


def _conversations_find_their_history(run: ServeRun, model_of: Callable[[int], str], kind: str) -> dict[str, int]:
    """Eight three-turn conversations at once (the i-th with model `model_of(i)`, their system prompts
    naming `kind`): every later turn finds the whole earlier prompt cached. The requests each replica took."""
    client = openai_client(run.url)
    before = _replica_tasks(run)

    def converse(index: int) -> list[tuple[int, int]]:
        system = f"You are {kind} assistant {index}. " + f"{kind} conversation {index} is about topic {index * 7}. " * 12
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Hello {index}."}]
        seen = []
        for turn in range(3):
            reply = client.chat.completions.create(model=model_of(index), messages=messages, max_tokens=6, temperature=0)
            seen.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"Tell me more, turn {turn}."}]
        return seen

    with ThreadPoolExecutor(8) as pool:
        conversations = list(pool.map(converse, range(8)))
    for turns in conversations:
        for (previous_prompt, _), (_, cached) in zip(turns, turns[1:]):
            assert cached >= (previous_prompt - 1) // PAGE * PAGE, turns  # the whole earlier prompt, in pages
    return {replica: count - before[replica] for replica, count in _replica_tasks(run).items()}


def test_every_turn_of_a_conversation_finds_its_history_cached(two_engines: ServeRun) -> None:
    tasks = _conversations_find_their_history(two_engines, lambda index: MODEL, "a base-model")
    assert len(tasks) == 2 and all(count > 0 for count in tasks.values()), tasks  # the conversations spread over both


def test_adapters_answer_through_the_sdks_and_their_conversations_find_their_pages(two_engines: ServeRun) -> None:
    """`<model>:<adapter>` through `serve run` with both SDKs, and every later turn of a conversation under
    an adapter finds its history."""
    client, claude = openai_client(two_engines.url), anthropic_client(two_engines.url)
    listed = {card.id: card.parent for card in client.models.list()}
    assert listed[f"{MODEL}:a"] == MODEL and listed[f"{MODEL}:b"] == MODEL
    ask = [{"role": "user", "content": "Name a colour."}]
    answers = {
        name: client.chat.completions.create(model=name, messages=ask, max_tokens=8, temperature=0).choices[0].message.content
        for name in (MODEL, f"{MODEL}:a", f"{MODEL}:b")
    }
    assert len(set(answers.values())) == 3, answers  # each adapter changes the answer
    message = claude.messages.create(model=f"{MODEL}:a", messages=ask, max_tokens=8, extra_body={"temperature": 0})
    assert message.content[0].text == answers[f"{MODEL}:a"] and message.model == f"{MODEL}:a"

    _conversations_find_their_history(two_engines, lambda index: f"{MODEL}:{'ab'[index % 2]}", "an adapter's")
    # Each adapter went where it was first loaded: loaded once in all, not on every replica it met.
    replicas = _replica_stats(two_engines).values()
    assert sum(s["lora_adapter_loads"] for s in replicas) == 2, list(replicas)


def test_two_models_in_one_app_each_answer_under_their_own_name(two_engines: ServeRun) -> None:
    """The tiny model is an engine deployment of its own: it answers under its name in the three APIs, is
    listed with the other model and its adapters, and a model served by neither is a 404 in each API's shape."""
    client, claude = openai_client(two_engines.url), anthropic_client(two_engines.url)
    listed = {card.id: card.parent for card in client.models.list()}
    assert listed == {MODEL: None, f"{MODEL}:a": MODEL, f"{MODEL}:b": MODEL, TINY: None}
    assert client.models.retrieve(TINY).id == TINY and client.models.retrieve(f"{MODEL}:a").parent == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(f"{TINY}:a")
    ask = [{"role": "user", "content": "Name a colour."}]
    answers = {}
    for model in (MODEL, TINY):
        chat = client.chat.completions.create(model=model, messages=ask, max_tokens=6, temperature=0)
        message = claude.messages.create(model=model, messages=ask, max_tokens=6, extra_body={"temperature": 0})
        response = client.responses.create(model=model, input=ask, max_output_tokens=6, temperature=0)
        assert chat.model == message.model == response.model == model
        assert message.content[0].text == chat.choices[0].message.content == response.output_text
        answers[model] = chat.choices[0].message.content
    assert answers[MODEL] != answers[TINY]  # a random tiny model does not talk like the trained one
    deadline = time.monotonic() + 10  # the replicas' task counts reach the board with their next heartbeat
    while time.monotonic() < deadline:
        tiny_replicas = _replica_stats(two_engines, TINY)
        if [s["total_tasks"] for s in tiny_replicas.values()] == [3]:
            break
        time.sleep(0.5)
    assert [s["total_tasks"] for s in tiny_replicas.values()] == [3]  # its three requests, on its one replica
    for path, body in (
        ("/v1/chat/completions", {"messages": ask, "max_tokens": 2}),
        ("/v1/messages", {"messages": ask, "max_tokens": 2}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
        ("/v1/messages/count_tokens", {"messages": ask}),
    ):
        reply = httpx.post(f"{two_engines.url}{path}", json={"model": "other", **body}, timeout=30)
        assert reply.status_code == 404, (path, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "not_found_error" and "'other' is not served here" in error["message"], (path, error)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=f"{TINY}x:a", messages=ask, max_tokens=2)


def test_the_choices_of_one_request_are_each_routed(two_engines: ServeRun) -> None:
    """Serve gives every call of one HTTP request the same internal id, by which a router that keeps no
    FIFO order matches calls to their pending requests: the ingress gives each engine call its own."""
    client = openai_client(two_engines.url)
    for _ in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4, n=4, temperature=1.0,
            seed=1, timeout=60,
        )
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]


def test_kv_lookups_and_retrieves_go_where_the_prefix_is(two_engines: ServeRun) -> None:
    context = connect(two_engines.url)
    post = make_post_completion(two_engines.url)
    for index in range(6):
        prompt = list(range(1000 + index * 100, 1000 + index * 100 + 3 * PAGE + 5))
        create_request(context, post, prompt, cache_salt=f"kv-{index}").generate({"max_tokens": 1, "temperature": 0})
        assert context.lookup(prompt, f"kv-{index}") == 3 * PAGE
        kv = context.retrieve(prompt, f"kv-{index}")
        assert kv is not None and kv.shape[2] == 3 * PAGE
        assert context.lookup(prompt, f"other-{index}") == 0  # another salt: nothing, on either replica
        assert context.store(kv, prompt[: 3 * PAGE], f"copy-{index}") is True
        assert context.lookup(prompt, f"copy-{index}") == 3 * PAGE  # the store is found where it landed


def test_the_kv_routes_reach_the_model_the_query_names(two_engines: ServeRun) -> None:
    smollm2, tiny = connect(two_engines.url), connect(two_engines.url, model=TINY)
    assert (smollm2.config.n_layers, tiny.config.n_layers) == (30, 2)
    prompt = list(range(3000, 3000 + 2 * PAGE + 3))
    create_request(tiny, make_post_completion(two_engines.url, model=TINY), prompt, cache_salt="tiny").generate(
        {"max_tokens": 1, "temperature": 0}
    )
    assert tiny.lookup(prompt, "tiny") == 2 * PAGE and smollm2.lookup(prompt, "tiny") == 0
    kv = tiny.retrieve(prompt, "tiny")
    assert kv is not None and kv.shape[1] == 2
    for model, status in (("other", 404), (f"{TINY}:a", 400)):
        with pytest.raises(KVError) as refused:
            connect(two_engines.url, model=model, timeout=5)
        assert refused.value.status == status and "model" in refused.value.message


def _settled_decisions(url: str) -> int:
    """The routers' decision count once their reports have caught up: a router reports at most every 2 s, after
    up to 1 s waiting for page news, so a count unchanged for 4 s includes every decision made before."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:
        now = sum(r["decisions"] for r in httpx.get(f"{url}/stats/routing", timeout=10).json().values())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 4:
            break
        time.sleep(0.5)
    return last


def test_the_router_reports_what_its_decisions_cost(two_engines: ServeRun) -> None:
    client = openai_client(two_engines.url)
    before = _settled_decisions(two_engines.url)
    started = time.time()
    for index in range(3):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {index}"}], max_tokens=2)
    for _ in range(10):  # each asks an engine replica for its adapters: a decision, but no request to list
        client.models.list()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        routers = httpx.get(f"{two_engines.url}/stats/routing", timeout=10).json()
        if sum(r["decisions"] for r in routers.values()) >= before + 13:
            break
        time.sleep(0.5)
    assert sum(r["decisions"] for r in routers.values()) >= before + 13, routers
    for costs in routers.values():
        assert 0 < costs["p50_us"] <= costs["p99_us"] <= costs["max_us"], costs
    # The latest requests (the live view shows them): where each went, and its prompt pages cached there. This
    # report came after the model list's calls, made after the chats, and they have not pushed the chats out.
    replicas = set(httpx.get(f"{two_engines.url}/stats/replicas", timeout=10).json())
    recent = [d for r in routers.values() for d in r["recent"]]
    assert recent and all(d["replica"] in replicas and 0 <= d["cached_pages"] <= d["pages"] for d in recent), recent
    chats = [d for d in recent if d["at"] >= round(started, 3)]
    assert len(chats) == 3 and all(d["pages"] >= 1 for d in chats), recent


def test_routing_in_serves_throughput_mode_and_after_the_router_idled(two_engines: ServeRun) -> None:
    assert two_engines.env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    check_routing_across_an_idle_spell(two_engines.url)


def test_haproxy_serves_the_port_and_forwards_to_the_ingress(two_engines: ServeRun) -> None:
    """HTTP reaches the ingress replica through HAProxy (installed by `ray[serve]` on Linux)."""
    assert two_engines.env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert httpx.get(f"{two_engines.url}/health", timeout=10).status_code == 200
    stats_port = two_engines.env["RAY_SERVE_HAPROXY_STATS_PORT"]
    csv = httpx.get(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=10).text
    # Columns 7 and 17 of HAProxy's CSV: sessions so far, and the server's status.
    ingress = [line.split(",") for line in csv.splitlines() if line.startswith("http-llm,SERVE_REPLICA_llm-Ingress")]
    assert ingress and all(row[17] == "UP" for row in ingress)
    assert sum(int(row[7]) for row in ingress) >= 1


def test_haproxy_side_ports_listen_on_the_config_host_only(two_engines: ServeRun) -> None:
    """Serve's HAProxy template binds its stats and metrics ports on every interface; ours bind 127.0.0.1."""
    ports = {int(two_engines.env[name]) for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")}
    listening: dict[int, set[str]] = {}
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] != "haproxy":
            continue
        try:
            for conn in proc.net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports:
                    listening.setdefault(conn.laddr.port, set()).add(conn.laddr.ip)
        except psutil.NoSuchProcess:
            continue
    assert listening == {port: {"127.0.0.1"} for port in ports}


def test_a_request_is_traced_through_the_ingress_the_router_and_the_engine(
    two_engines: ServeRun, traces: TraceReceiver
) -> None:
    """With `otlp_traces_endpoint` set, one request is one trace: the ingress's span, and under it the router's
    decision and the engine replica's generation, each sent by its own process to the OTLP endpoint."""
    reply = openai_client(two_engines.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Trace me."}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )
    engines = set(httpx.get(f"{two_engines.url}/stats/replicas", timeout=10).json())
    deadline = time.monotonic() + 60
    while True:
        ingress = [s for s in traces.spans if s.name == "ingress" and s.attributes.get("gen_ai.usage.output_tokens") == 3
                   and s.attributes.get("gen_ai.usage.input_tokens") == reply.usage.prompt_tokens]
        ids = {s.trace_id for s in ingress}
        children = {name: [s for s in traces.spans if s.name == name and s.trace_id in ids] for name in ("route", "engine")}
        if ingress and all(children.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ingress and all(children.values()), [(s.service, s.name) for s in traces.spans][-20:]
    root = next(s for s in ingress if any(c.trace_id == s.trace_id for c in children["engine"]))
    assert root.service == "serve-app-ingress" and root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    route = [s for s in children["route"] if s.trace_id == root.trace_id]
    engine = [s for s in children["engine"] if s.trace_id == root.trace_id]
    assert route and all(s.parent_span_id == root.span_id and s.service == "serve-app-ingress" for s in route)
    assert len(engine) == 1 and engine[0].parent_span_id == root.span_id and engine[0].service == "serve-app-engine"
    assert engine[0].attributes["serve_app.replica"] in engines
    assert engine[0].attributes["gen_ai.usage.output_tokens"] == 3 and engine[0].attributes["serve_app.queue_time_s"] >= 0
    assert set(route[-1].attributes["serve_app.replicas_first"]) <= engines


@needs_chromium
def test_the_live_view_shows_each_replica_and_the_routers_recent_decisions(two_engines: ServeRun, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    replicas = set(httpx.get(f"{two_engines.url}/stats/replicas", timeout=10).json())
    browser.get(f"{two_engines.url}/")
    openai_client(two_engines.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Route me."}], max_tokens=2
    )

    def column(table: str, index: int) -> set[str]:
        rows = browser.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")
        return {row.find_elements(By.TAG_NAME, "td")[index].text for row in rows}

    wait = WebDriverWait(browser, 60, poll_frequency=0.5)
    wait.until(lambda _: column("replicas", 0) == replicas)
    wait.until(lambda _: column("decisions", 1) and column("decisions", 1) <= replicas)
    assert browser.find_element(By.ID, "live-error").text == ""
