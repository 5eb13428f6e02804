"""The vLLM-protocol client against the real built-in engine (`manage.py serve_model` subprocesses).

Covers streaming and non-streaming chat with logprobs and token ids, adapter load/unload, errors,
activation as hot-load with bit-identical rollback, and two replicas (activation on both,
affinity, failover, a restarted replica getting its adapters back).
"""
import httpx
import pytest

from serving import services
from serving.client import InferenceClient, InferenceError, InferenceUnavailable, SamplingParams
from serving.engine.testing import free_port, run_engine_server
from serving.tests.test_adapters import make_peft_dir

AGENT = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, seed=0)
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with run_engine_server(tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def second_engine(tiny_model_dir):
    with run_engine_server(tiny_model_dir) as server:
        yield server


@pytest.fixture
def client(engine):
    return InferenceClient([engine.url], base_model="base", timeout=60)


@pytest.fixture
def model_settings(settings, tiny_model_dir):
    settings.MODEL = str(tiny_model_dir)
    settings.SERVED_MODEL_NAME = "base"
    return settings


@pytest.fixture(scope="module")
def sources(tiny_model_dir, tmp_path_factory):
    """Two different real PEFT adapters for the tiny model."""
    root = tmp_path_factory.mktemp("sources")
    return [make_peft_dir(root / f"s{seed}", model_dir=tiny_model_dir, seed=seed, target_modules=TARGETS) for seed in (1, 2)]


def loaded_on(url):
    return {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} - {"base"}


async def collect(stream):
    return [event async for event in stream]


# -- chat ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stream_chat_yields_text_token_ids_and_logprobs(client):
    events = await collect(client.stream_chat(MESSAGES, adapter=None, params=GREEDY))
    assert events[0].prompt_token_ids and all(e.prompt_token_ids is None for e in events[1:])
    token_ids = [t for e in events for t in e.token_ids]
    logprobs = [lp for e in events for lp in e.logprobs]
    assert 0 < len(token_ids) <= GREEDY.max_tokens and len(logprobs) == len(token_ids)
    assert all(lp <= 0.0 for lp in logprobs)
    assert events[-1].finish_reason in {"stop", "length"}


@pytest.mark.asyncio
async def test_chat_gives_the_streamed_greedy_reply(client):
    events = await collect(client.stream_chat(MESSAGES, adapter=None, params=GREEDY))
    completion = await client.chat(MESSAGES, adapter=None, params=GREEDY)
    assert completion.text == "".join(e.text for e in events)
    assert completion.token_ids == [t for e in events for t in e.token_ids]
    assert completion.prompt_token_ids == events[0].prompt_token_ids
    assert len(completion.logprobs) == len(completion.token_ids)
    assert completion.adapter is None


def test_chat_sync_works_outside_an_event_loop(client):
    completion = client.chat_sync(MESSAGES, params=GREEDY)
    assert completion.token_ids and completion.finish_reason in {"stop", "length"}


@pytest.mark.asyncio
async def test_unknown_adapter_is_an_inference_error_with_the_servers_message(client):
    with pytest.raises(InferenceError) as excinfo:
        await client.chat(MESSAGES, adapter="u1-a1-v99", params=GREEDY)
    assert excinfo.value.status_code == 404 and "does not exist" in excinfo.value.message


@pytest.mark.asyncio
async def test_a_server_that_is_down_raises_inference_unavailable():
    client = InferenceClient([f"http://127.0.0.1:{free_port()}"], base_model="base", timeout=5)
    with pytest.raises(InferenceUnavailable):
        await client.chat(MESSAGES, params=GREEDY)
    with pytest.raises(InferenceUnavailable):
        await collect(client.stream_chat(MESSAGES, params=GREEDY))
    health = await client.health()
    assert [state["ok"] for state in health.values()] == [False]


# -- adapters ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_load_adapter_serves_it_and_unload_removes_it(client, engine, sources):
    base = await client.chat(MESSAGES, params=GREEDY)
    await client.load_adapter("u1-a1-v1", sources[0])
    try:
        tuned = await client.chat(MESSAGES, adapter="u1-a1-v1", params=GREEDY)
        assert tuned.token_ids != base.token_ids and tuned.adapter == "u1-a1-v1"
        health = await client.health()
        assert health[engine.url] == {"ok": True, "adapters": ["u1-a1-v1"], "error": None}
        await client.load_adapter("u1-a1-v1", sources[0])  # loading the same name again is a no-op
    finally:
        assert await client.unload_adapter("u1-a1-v1") == {engine.url: True}
    with pytest.raises(InferenceError):
        await client.chat(MESSAGES, adapter="u1-a1-v1", params=GREEDY)
    assert await client.unload_adapter("u1-a1-v1") == {engine.url: False}


@pytest.mark.asyncio
async def test_load_adapter_reports_a_bad_path(client):
    with pytest.raises(InferenceError):
        await client.load_adapter("u1-a1-v2", "/nonexistent/adapter")


# -- activation ----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_activation_hot_loads_and_rollback_is_bit_identical(client, engine, sources, user, model_settings):
    v1 = services.publish_version(user_id=user.pk, agent_id=AGENT, source_dir=sources[0])
    v2 = services.publish_version(user_id=user.pk, agent_id=AGENT, source_dir=sources[1])

    def reply():
        active = services.active_version_for(user.pk, AGENT)
        return client.chat_sync(MESSAGES, adapter=active and active.name, params=GREEDY)

    base = reply()
    services.activate_version(v1, user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
    first = reply()
    services.activate_version(v2, user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
    second = reply()
    assert loaded_on(engine.url) == {v2.name}  # the previous version was unloaded after the flip
    services.rollback(user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
    rolled_back = reply()
    services.activate_version(None, user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
    reset = reply()

    assert len({tuple(base.token_ids), tuple(first.token_ids), tuple(second.token_ids)}) == 3
    assert (rolled_back.text, rolled_back.token_ids, rolled_back.logprobs) == (first.text, first.token_ids, first.logprobs)
    assert (reset.text, reset.token_ids) == (base.text, base.token_ids)
    assert loaded_on(engine.url) == set()


# -- two replicas ------------------------------------------------------------------------------


def key_preferring(client, url):
    return next(k for k in (f"user-{i}" for i in range(1000)) if client.replica_order(k)[0] == url)


@pytest.mark.django_db(transaction=True)
def test_activation_loads_on_every_replica(engine, second_engine, sources, user, model_settings):
    client = InferenceClient([engine.url, second_engine.url], base_model="base", timeout=60)
    version = services.publish_version(user_id=user.pk, agent_id=AGENT, source_dir=sources[0])
    services.activate_version(version, user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
    try:
        assert version.name in loaded_on(engine.url) and version.name in loaded_on(second_engine.url)
    finally:
        client.unload_adapter_sync(version.name)


@pytest.mark.django_db(transaction=True)
def test_activation_changes_nothing_if_one_replica_is_down(engine, sources, user, model_settings):
    client = InferenceClient([engine.url, f"http://127.0.0.1:{free_port()}"], base_model="base", timeout=10)
    version = services.publish_version(user_id=user.pk, agent_id=AGENT, source_dir=sources[0])
    with pytest.raises(InferenceUnavailable):
        services.activate_version(version, user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
    assert services.active_version_for(user.pk, AGENT) is None
    assert version.name not in loaded_on(engine.url)  # the replica that did load it unloaded it again


@pytest.mark.asyncio
async def test_affinity_keeps_a_users_requests_on_one_replica(engine, second_engine, sources):
    client = InferenceClient([engine.url, second_engine.url], base_model="base", timeout=60)
    await client.load_adapter("u5-a5-v1", sources[0], urls=[engine.url])  # only the first replica holds it
    try:
        stays = key_preferring(client, engine.url)
        for _ in range(4):
            await client.chat(MESSAGES, adapter="u5-a5-v1", params=GREEDY, affinity_key=stays)
        with pytest.raises(InferenceError):  # proves routing follows the key: the other replica lacks it
            await client.chat(MESSAGES, adapter="u5-a5-v1", params=GREEDY, affinity_key=key_preferring(client, second_engine.url))
    finally:
        await client.unload_adapter("u5-a5-v1")


@pytest.mark.django_db(transaction=True)
def test_a_restarted_replica_gets_the_active_adapters_again(engine, tiny_model_dir, sources, user, model_settings):
    with run_engine_server(tiny_model_dir) as replica:
        port = replica.port
        client = InferenceClient([engine.url, replica.url], base_model="base", timeout=60,
                                 on_missing_adapter=services.arestore_adapter)
        version = services.publish_version(user_id=user.pk, agent_id=AGENT, source_dir=sources[0])
        services.activate_version(version, user_id=user.pk, agent_id=AGENT, actor_label="test", client=client)
        expected = client.chat_sync(MESSAGES, adapter=version.name, params=GREEDY)
        on_replica = key_preferring(client, replica.url)

        replica.process.kill()
        replica.process.wait()
        # While it is down, its users fail over to the live replica.
        assert client.chat_sync(MESSAGES, adapter=version.name, params=GREEDY, affinity_key=on_replica).text == expected.text

    with run_engine_server(tiny_model_dir, port=port) as restarted:
        assert loaded_on(restarted.url) == set()
        # A request that lands on it reloads the adapter from the store (404 -> restore -> retry).
        client._down_until.clear()
        reply = client.chat_sync(MESSAGES, adapter=version.name, params=GREEDY, affinity_key=on_replica)
        assert reply.token_ids == expected.token_ids
        assert loaded_on(restarted.url) == {version.name}
        # ensure_replica_adapters does the same for every active version, at startup.
        client.unload_adapter_sync(version.name, urls=[restarted.url])
        assert services.ensure_replica_adapters(client) == {engine.url: [], restarted.url: [version.name]}
        assert loaded_on(restarted.url) == {version.name}
    client.unload_adapter_sync(version.name, urls=[engine.url])
