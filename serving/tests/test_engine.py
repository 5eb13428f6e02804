"""The built-in engine: numeric checks in-process, HTTP checks against a real `serve_model` subprocess."""
import asyncio
import json
import shutil
import threading
import time

import httpx
import pytest
import torch

from serving.engine.adapters import AdapterError
from serving.engine.engine import Engine
from serving.engine.testing import make_peft_adapter, run_engine_server
from serving.protocol import SamplingParams

PROMPTS = ["hello there", "what is your name?", "tell me a story about cats"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-adapters")
    dirs = [make_peft_adapter(tiny_model_dir, root / f"ad{i}", seed=i, std=0.1) for i in range(3)]
    dirs.append(make_peft_adapter(tiny_model_dir, root / "qv-only", seed=7, std=0.1, rank=2,
                                  target_modules=("q_proj", "v_proj")))
    return dirs


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapter_dirs):
    engine = Engine(tiny_model_dir, device="cpu", max_loras=8).start()

    async def load():
        for i, path in enumerate(adapter_dirs):
            await engine.add_adapter(f"a{i}", str(path))

    asyncio.run(load())
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with run_engine_server(tiny_model_dir, extra_args=["--max-loras", "4"]) as server:
        yield server


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def prompt_ids(engine, text):
    return engine.render_chat([{"role": "user", "content": text}])


def run(coro):
    return asyncio.run(coro)


def run_together(coros):
    """Run the coroutines concurrently on one loop, so the engine batches them."""
    async def together():
        return await asyncio.gather(*coros)

    return asyncio.run(together())


def chat_body(model, text="hello there", **extra):
    return {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 16,
            **extra}


def sse_events(lines):
    """Parse an SSE body into its JSON events; asserts the framing on the way."""
    events, done = [], False
    for block in lines.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "event after [DONE]"
        events.append(json.loads(payload))
    assert done
    return events


# ---------------------------------------------------------------------- numerics (in-process engine)


def test_adapters_change_the_greedy_output(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    texts = run_together([engine.complete(ids, GREEDY, adapter=a) for a in (None, "a0", "a1", "a2")])
    assert len({t[0] for t in texts}) == 4


def test_mixed_adapter_batch_matches_one_at_a_time(engine):
    models = [None, "a0", "a1", "a2", "a3"]
    jobs = [(model, prompt_ids(engine, p)) for model in models for p in PROMPTS]
    alone = [run(engine.complete(ids, GREEDY, adapter=model))[1] for model, ids in jobs]

    batched = [r[1] for r in run_together([engine.complete(ids, GREEDY, adapter=model) for model, ids in jobs])]
    assert batched == alone


@pytest.mark.parametrize("adapter_index", [None, 0, 3])
def test_greedy_matches_peft_single_adapter_generate(engine, tiny_model_dir, adapter_dirs, adapter_index):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if adapter_index is not None:
        reference = PeftModel.from_pretrained(reference, str(adapter_dirs[adapter_index]))
    reference.eval()
    adapter = None if adapter_index is None else f"a{adapter_index}"
    for text in PROMPTS:
        ids = prompt_ids(engine, text)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                     eos_token_id=sorted(engine.eos_token_ids), pad_token_id=engine.pad_token_id)
        expected = out[0, len(ids):].tolist()
        _, got, _, _ = run(engine.complete(ids, GREEDY, adapter=adapter))
        assert got == expected


def test_logprobs_are_the_reference_models_raw_logprobs(engine, tiny_model_dir, adapter_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), str(adapter_dirs[1])).eval()
    ids = prompt_ids(engine, PROMPTS[2])
    _, tokens, logprobs, _ = run(engine.complete(ids, SamplingParams(temperature=0.8, seed=5, max_tokens=12),
                                                 adapter="a1"))
    with torch.no_grad():
        logits = reference(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


def test_seeded_sampling_is_reproducible(engine):
    ids = prompt_ids(engine, PROMPTS[1])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    first = run(engine.complete(ids, params, adapter="a2"))
    second = run(engine.complete(ids, params, adapter="a2"))
    assert first[1] == second[1]


def test_rollback_to_the_same_files_is_bit_identical(engine, adapter_dirs):
    ids = prompt_ids(engine, PROMPTS[2])
    params = SamplingParams(temperature=0.7, seed=99, max_tokens=16)
    before = run(engine.complete(ids, params, adapter="a0"))

    async def unload_and_reload():
        await engine.remove_adapter("a0")
        await engine.add_adapter("a0-rollback", str(adapter_dirs[0]))

    run(unload_and_reload())
    after = run(engine.complete(ids, params, adapter="a0-rollback"))
    assert after[1] == before[1] and after[2] == before[2]

    async def restore():
        await engine.remove_adapter("a0-rollback")
        await engine.add_adapter("a0", str(adapter_dirs[0]))

    run(restore())


def test_a_name_reloaded_while_its_stream_runs_leaves_the_stream_alone(engine, adapter_dirs):
    ids = prompt_ids(engine, PROMPTS[1])
    long_params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    expected_old = run(engine.complete(ids, long_params, adapter="a0"))[1]
    expected_new = run(engine.complete(ids, GREEDY, adapter="a2"))[1]

    async def scenario():
        await engine.add_adapter("swapped", str(adapter_dirs[0]))
        stream = engine.generate(ids, long_params, adapter="swapped")
        old = (await stream.__anext__()).token_ids
        await engine.remove_adapter("swapped")
        await engine.add_adapter("swapped", str(adapter_dirs[2]))
        new = (await engine.complete(ids, GREEDY, adapter="swapped"))[1]
        async for out in stream:
            old += out.token_ids
        await engine.remove_adapter("swapped")
        return old, new

    old, new = run(scenario())
    assert new == expected_new and old == expected_old


def test_lru_evicts_the_least_recently_used_idle_adapter(tiny_model_dir, adapter_dirs):
    with Engine(tiny_model_dir, device="cpu", max_loras=2) as small:
        async def scenario():
            await small.add_adapter("x0", str(adapter_dirs[0]))
            await small.add_adapter("x1", str(adapter_dirs[1]))
            await small.complete(prompt_ids(small, "hi"), GREEDY, adapter="x0")  # x0 is now the most recent
            await small.add_adapter("x2", str(adapter_dirs[2]))
            return small.resident_adapters()

        assert run(scenario()) == ["x0", "x2"]


def test_evicted_adapter_reloads_on_demand_with_identical_output(tiny_model_dir, adapter_dirs, engine):
    ids = prompt_ids(engine, PROMPTS[0])
    expected = run(engine.complete(ids, GREEDY, adapter="a1"))[1]
    with Engine(tiny_model_dir, device="cpu", max_loras=1) as small:
        async def scenario():
            await small.add_adapter("x1", str(adapter_dirs[1]))
            await small.add_adapter("x2", str(adapter_dirs[2]))  # evicts x1
            assert small.resident_adapters() == ["x2"]
            return await small.complete(ids, GREEDY, adapter="x1")

        assert run(scenario())[1] == expected


def test_adapter_in_use_is_never_evicted(tiny_model_dir, adapter_dirs):
    with Engine(tiny_model_dir, device="cpu", max_loras=2) as small:
        async def scenario():
            await small.add_adapter("busy", str(adapter_dirs[0]))
            stream = small.generate(prompt_ids(small, "hi"), SamplingParams(temperature=0, max_tokens=200,
                                                                            ignore_eos=True), adapter="busy")
            await stream.__anext__()  # the request is running and holds its slot
            await small.add_adapter("y1", str(adapter_dirs[1]))
            await small.add_adapter("y2", str(adapter_dirs[2]))
            await small.add_adapter("y3", str(adapter_dirs[3]))
            resident = small.resident_adapters()
            await stream.aclose()
            return resident

        resident = run(scenario())
        assert "busy" in resident and len(resident) == 2


def test_pickle_only_adapter_is_refused(engine, adapter_dirs, tmp_path):
    pickle_dir = tmp_path / "pickle-only"
    pickle_dir.mkdir()
    shutil.copy(adapter_dirs[0] / "adapter_config.json", pickle_dir)
    (pickle_dir / "adapter_model.bin").write_bytes(b"not loaded, ever")
    with pytest.raises(AdapterError, match="never loaded") as info:
        run(engine.add_adapter("pickle", str(pickle_dir)))
    assert info.value.status_code == 400 and not engine.has_adapter("pickle")


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"r": 512}, "max LoRA rank"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"peft_type": "IA3"}, "LORA"),
])
def test_unsupported_adapter_config_is_refused(engine, adapter_dirs, tmp_path, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dirs[0], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AdapterError, match=message) as info:
        run(engine.add_adapter("bad", str(bad)))
    assert info.value.status_code == 400


def test_prompt_longer_than_the_context_is_refused_not_truncated(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        run(engine.complete(list(range(5, 5 + engine.max_model_len)), GREEDY))


def test_stop_string_cuts_the_text(engine):
    ids = prompt_ids(engine, PROMPTS[0])
    text, _, _, _ = run(engine.complete(ids, SamplingParams(temperature=0, max_tokens=16)))
    stop = text[3:5]
    cut, _, _, finish = run(engine.complete(ids, SamplingParams(temperature=0, max_tokens=16, stop=[stop])))
    assert cut == text[:text.index(stop)] and finish == "stop"


def test_step_delay_paces_the_stream_and_leaves_the_event_loop_free(tiny_model_dir):
    delay, tokens = 0.05, 12
    with Engine(tiny_model_dir, device="cpu", step_delay=delay) as paced:
        ids = prompt_ids(paced, PROMPTS[0])

        async def scenario():
            ticks, streaming = 0, True

            async def ticker():  # counts how often the event loop gets to run meanwhile
                nonlocal ticks
                while streaming:
                    await asyncio.sleep(0.005)
                    ticks += 1

            task = asyncio.create_task(ticker())
            arrivals = []
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            async for _ in paced.generate(ids, params):
                arrivals.append(time.monotonic())
            streaming = False
            await task
            return arrivals, ticks

        arrivals, ticks = run(scenario())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) == tokens
    # Loosely: each step waits `delay`, and asyncio hand-off jitter may shift single arrivals.
    assert arrivals[-1] - arrivals[0] >= (tokens - 1) * delay * 0.9
    assert sorted(gaps)[len(gaps) // 2] >= delay * 0.9
    # The wait happens on the model thread, so the loop kept running: about 10 ticks per gap when
    # idle; a wait on the loop itself would leave about one.
    assert ticks >= 3 * tokens


def test_step_delay_changes_the_pace_not_the_tokens(engine, tiny_model_dir):
    ids = prompt_ids(engine, PROMPTS[2])
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=8)
    expected = run(engine.complete(ids, params))
    with Engine(tiny_model_dir, device="cpu", step_delay=0.01) as paced:
        assert run(paced.complete(ids, params)) == expected


def test_shutdown_and_stop_do_not_wait_out_a_long_step_delay(tiny_model_dir):
    with Engine(tiny_model_dir, device="cpu", step_delay=30) as paced:
        ids = prompt_ids(paced, PROMPTS[0])

        async def first_token_then_stop():
            stream = paced.generate(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
            first = await stream.__anext__()
            await stream.aclose()  # the client went away: the request is aborted
            return first

        assert run(first_token_then_stop()).token_ids
        started = time.monotonic()
        paced.shutdown()
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("delay", [-0.1, float("nan")])
def test_a_negative_step_delay_is_refused(tiny_model_dir, delay):
    with pytest.raises(ValueError, match="step_delay"):
        Engine(tiny_model_dir, device="cpu", step_delay=delay)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_serve_model_refuses_a_bad_step_delay(value):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="step-delay"):
        call_command("serve_model", "--step-delay", value)


# ---------------------------------------------------------------------- HTTP (real subprocess server)


def test_unknown_model_is_a_vllm_404(http):
    response = http.post("/v1/chat/completions", json=chat_body("u9-a9-v9"))
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `u9-a9-v9` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}


def test_models_lists_the_base_and_loaded_adapters(http, adapter_dirs):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "listed", "lora_path": str(adapter_dirs[0])}).status_code == 200
    ids = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert ids[0] == "base" and "listed" in ids
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "listed"}).status_code == 200
    assert "listed" not in [card["id"] for card in http.get("/v1/models").json()["data"]]


def test_loading_a_name_already_loaded_is_a_400(http, adapter_dirs):
    body = {"lora_name": "twice", "lora_path": str(adapter_dirs[1])}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400 and "has already been loaded" in response.json()["error"]["message"]
    http.post("/v1/unload_lora_adapter", json={"lora_name": "twice"})


def test_unloading_an_unknown_name_is_a_404(http):
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"


def test_pickle_only_adapter_is_a_400_over_http(http, adapter_dirs, tmp_path):
    (tmp_path / "adapter_config.json").write_text((adapter_dirs[0] / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "pkl", "lora_path": str(tmp_path)})
    assert response.status_code == 400 and "adapter_model.safetensors" in response.json()["error"]["message"]


def test_stream_is_sse_ending_with_done(http):
    body = chat_body("base", stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read().decode())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["prompt_token_ids"]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


def test_logprobs_match_token_ids(http):
    body = chat_body("base", logprobs=True, return_token_ids=True, temperature=1.0, seed=3)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) > 0
    assert all(entry["logprob"] <= 0 for entry in choice["logprobs"]["content"])


def test_streamed_logprobs_match_streamed_token_ids(http):
    body = chat_body("base", stream=True, logprobs=True, return_token_ids=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = sse_events(response.read().decode())
    token_ids = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    logprobs = [c for e in events[1:] for c in e["choices"][0]["logprobs"]["content"]]
    assert len(token_ids) == len(logprobs) > 0


def test_prompt_longer_than_the_context_is_a_400(http):
    response = http.post("/v1/chat/completions", json=chat_body("base", text="word " * 2000))
    assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]


def test_hot_load_does_not_pause_a_stream_in_flight(http, server, adapter_dirs, engine):
    ids = prompt_ids(engine, PROMPTS[1])
    long_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    expected_long = run(engine.complete(ids, long_params, adapter="a0"))[1]
    expected_new = run(engine.complete(ids, GREEDY, adapter="a2"))[0]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "long", "lora_path": str(adapter_dirs[0])}).status_code == 200

    streamed, started = [], threading.Event()

    def stream_long():
        body = chat_body("long", text=PROMPTS[1], max_tokens=400, ignore_eos=True, stream=True,
                         return_token_ids=True)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        streamed.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                        if len(streamed) >= 3:
                            started.set()

    thread = threading.Thread(target=stream_long)
    thread.start()
    assert started.wait(60)
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(adapter_dirs[2])})
    assert loaded.status_code == 200
    tokens_at_load = len(streamed)
    reply = http.post("/v1/chat/completions", json=chat_body("fresh", text=PROMPTS[1])).json()
    assert reply["choices"][0]["message"]["content"] == expected_new
    thread.join(120)
    assert streamed == expected_long and tokens_at_load < len(expected_long)
    for name in ("long", "fresh"):
        http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_serve_model_step_delay_paces_http_streaming_and_health_stays_prompt(tiny_model_dir):
    delay, tokens = 0.05, 16
    body = chat_body("base", text=PROMPTS[1], max_tokens=tokens, ignore_eos=True, stream=True)
    with run_engine_server(tiny_model_dir, extra_args=["--step-delay", str(delay)]) as paced:
        assert f"pausing {delay} s between steps" in paced.log()
        arrivals, health = [], []
        with httpx.Client(base_url=paced.url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        arrivals.append(time.monotonic())
                        if len(arrivals) == 3:  # mid-stream: the HTTP side still answers at once
                            with httpx.Client(base_url=paced.url, timeout=60) as other:
                                asked = time.monotonic()
                                health.append((other.get("/health").status_code, time.monotonic() - asked))
    # role chunk + one chunk per token (finish_reason on the last)
    assert len(arrivals) == tokens + 1
    assert arrivals[-1] - arrivals[1] >= (tokens - 1) * delay * 0.8
    status, took = health[0]
    assert status == 200 and took < 2.0
