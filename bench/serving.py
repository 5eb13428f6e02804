"""Serving benchmark of the built-in engine (issue "Serving", section 5), CPU.

    .venv/bin/python bench/serving.py                  # the demo model (built if missing)
    .venv/bin/python bench/serving.py --quick          # the tiny test model, shorter runs
    .venv/bin/python bench/serving.py --model DIR      # any Hugging Face causal LM directory

All ratios come from one run, measured side by side:
    P1  aggregate tokens/s of 16 concurrent streams, each on its own adapter, / 16 streams on base,
        through the same engine (target >= 0.8)
    P2  those 16 adapter streams / the naive approach: sequential PeftModel.generate with
        set_adapter per request (target >= 4)
    P3  time from the start of an adapter load to its first streamed token over HTTP while 8
        streams keep the server busy (target <= 1 s), and failed requests meanwhile (target 0)
    M1  engine RSS with 64 adapters loaded minus with none, / the adapters' size on disk (<= 2)
Prints NAME=value lines.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "clawplatform.settings.local")

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from serving.engine.engine import Engine  # noqa: E402
from serving.engine.testing import make_peft_adapter, run_engine_server  # noqa: E402
from serving.protocol import SamplingParams  # noqa: E402

STREAMS = 16
PROMPTS = ["hello there", "what is your name?", "tell me a story about cats", "how do I list files?"]


def default_model(quick):
    from serving.demo_model import DemoModelConfig, build_demo_model, is_built

    if quick:
        config = DemoModelConfig.tiny()
        return build_demo_model(REPO / "var" / "test-cache" / f"tiny-{config.fingerprint()}", config, progress=False)
    directory = Path(os.environ.get("DATA_DIR", REPO / "var")) / "models" / "demo-chat"
    config = DemoModelConfig()
    if not is_built(directory, config):
        build_demo_model(directory, config, progress=True)
    return directory


def make_adapters(model_dir, root, count, rank):
    """`count` real PEFT adapters: one made by peft, the rest the same files with fresh random weights."""
    first = make_peft_adapter(model_dir, root / "ad000", rank=rank, alpha=2 * rank, seed=0, std=0.05)
    tensors = load_file(str(first / "adapter_model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    dirs = [first]
    for i in range(1, count):
        directory = root / f"ad{i:03d}"
        directory.mkdir()
        shutil.copy(first / "adapter_config.json", directory)
        save_file({k: torch.randn(v.shape, generator=generator) * 0.05 for k, v in tensors.items()},
                  str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        dirs.append(directory)
    return dirs


def rss_bytes():
    gc.collect()
    try:  # give freed heap pages back so that RSS counts what is held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def engine_throughput(engine, prompts, adapters, tokens):
    """Aggregate generated tokens/s of len(adapters) concurrent requests (None = base)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    results = await asyncio.gather(*[engine.complete(prompts[i % len(prompts)], params, adapter=adapter)
                                     for i, adapter in enumerate(adapters)])
    elapsed = time.perf_counter() - started
    return sum(len(r[1]) for r in results) / elapsed


def naive_throughput(model_dir, adapter_dirs, prompts, tokens):
    """Tokens/s of one request after another, each on its own adapter, via peft's set_adapter + generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dirs[0]), adapter_name="n0")
    for i, directory in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(str(directory), adapter_name=f"n{i}")
    model.eval()
    generated = 0
    started = time.perf_counter()
    with torch.no_grad():
        for i in range(len(adapter_dirs)):
            model.set_adapter(f"n{i}")
            ids = torch.tensor([prompts[i % len(prompts)]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            generated += out.shape[1] - ids.shape[1]
    return generated / (time.perf_counter() - started)


def measure_p1_p2(model_dir, adapter_dirs, tokens, rounds):
    engine = Engine(model_dir, device="cpu", max_loras=64, max_batch=32).start()
    prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in PROMPTS]

    async def run():
        for i, directory in enumerate(adapter_dirs[:STREAMS]):
            await engine.add_adapter(f"p{i}", str(directory))
        await engine_throughput(engine, prompts, [None] * STREAMS, 4)  # warm-up
        await engine_throughput(engine, prompts, [f"p{i}" for i in range(STREAMS)], 4)
        base, mixed = [], []
        for _ in range(rounds):  # interleaved, so that machine load hits both alike
            base.append(await engine_throughput(engine, prompts, [None] * STREAMS, tokens))
            mixed.append(await engine_throughput(engine, prompts, [f"p{i}" for i in range(STREAMS)], tokens))
        return statistics.median(base), statistics.median(mixed)

    base_tps, adapters_tps = asyncio.run(run())
    engine.shutdown()
    naive_tps = naive_throughput(model_dir, adapter_dirs[:STREAMS], prompts, tokens)
    return base_tps, adapters_tps, naive_tps


def measure_m1(model_dir, adapter_dirs):
    engine = Engine(model_dir, device="cpu", max_loras=len(adapter_dirs)).start()
    prompt = engine.render_chat([{"role": "user", "content": PROMPTS[0]}])

    async def run():
        await engine.complete(prompt, SamplingParams(temperature=0, max_tokens=4))
        before = rss_bytes()
        for i, directory in enumerate(adapter_dirs):
            await engine.add_adapter(f"m{i}", str(directory))
        await engine.complete(prompt, SamplingParams(temperature=0, max_tokens=4), adapter="m0")
        return before, rss_bytes()

    before, after = asyncio.run(run())
    assert len(engine.resident_adapters()) == len(adapter_dirs)
    engine.shutdown()
    disk = sum((d / "adapter_model.safetensors").stat().st_size for d in adapter_dirs)
    return (after - before) / disk, after - before, disk


def measure_p3(model_dir, adapter_dirs, swaps, tokens):
    """Hot-load adapters over HTTP while 8 streams keep the server busy."""
    failures, first_token_s, stop = [], [], threading.Event()
    with run_engine_server(model_dir, env={"DJANGO_SETTINGS_MODULE": "clawplatform.settings.local"},
                           extra_args=["--max-loras", "8", "--threads", str(torch.get_num_threads())]) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for i in range(4):
                client.post("/v1/load_lora_adapter", json={"lora_name": f"bg{i}", "lora_path": str(adapter_dirs[i])})

        def background(worker):
            with httpx.Client(base_url=server.url, timeout=120) as client:
                while not stop.is_set():
                    body = {"model": f"bg{worker % 4}", "messages": [{"role": "user", "content": PROMPTS[worker % 4]}],
                            "max_tokens": tokens, "temperature": 0.7, "stream": True}
                    try:
                        with client.stream("POST", "/v1/chat/completions", json=body) as response:
                            text = response.read().decode()
                            if response.status_code != 200 or not text.rstrip().endswith("data: [DONE]"):
                                failures.append(f"bg {response.status_code}")
                    except httpx.HTTPError as exc:
                        failures.append(f"bg {exc!r}")

        workers = [threading.Thread(target=background, args=(w,)) for w in range(8)]
        for worker in workers:
            worker.start()
        time.sleep(1.0)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for k in range(swaps):
                name = f"swap{k}"
                started = time.perf_counter()
                loaded = client.post("/v1/load_lora_adapter",
                                     json={"lora_name": name, "lora_path": str(adapter_dirs[4 + k])})
                if loaded.status_code != 200:
                    failures.append(f"load {loaded.status_code} {loaded.text}")
                    continue
                body = {"model": name, "messages": [{"role": "user", "content": PROMPTS[k % 4]}], "max_tokens": 4,
                        "temperature": 0, "stream": True}
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                            first_token_s.append(time.perf_counter() - started)
                            break
                    else:
                        failures.append(f"swap {response.status_code}")
                if k >= 2:
                    client.post("/v1/unload_lora_adapter", json={"lora_name": f"swap{k - 2}"})
        stop.set()
        for worker in workers:
            worker.join(180)
    return first_token_s, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, fewer tokens and rounds")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the benchmark adapters")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 by default: on a shared 2-core box, OpenMP spinning makes "
                             "multi-threaded small matmuls 10x slower and the numbers noise)")
    args = parser.parse_args()

    import logging

    import django

    django.setup()
    torch.set_num_threads(args.threads)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = Path(args.model) if args.model else default_model(args.quick)
    tokens, rounds, swaps = (32, 5, 5) if args.quick else (48, 5, 10)
    print(f"model={model_dir} torch_threads={torch.get_num_threads()} tokens_per_stream={tokens} rank={args.rank}")
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        adapter_dirs = make_adapters(model_dir, Path(tmp), 64, args.rank)

        m1, delta, disk = measure_m1(model_dir, adapter_dirs)
        print(f"M1_rss_delta_bytes={delta} M1_adapters_on_disk_bytes={disk}")

        base_tps, adapters_tps, naive_tps = measure_p1_p2(model_dir, adapter_dirs, tokens, rounds)
        print(f"base_16_streams_tok_s={base_tps:.1f} adapters_16_streams_tok_s={adapters_tps:.1f} "
              f"naive_sequential_peft_tok_s={naive_tps:.1f}")

        first_token_s, failures = measure_p3(model_dir, adapter_dirs, swaps, tokens)
        for failure in failures[:5]:
            print(f"P3_failure={failure}")

    print(f"P1_adapters_vs_base_ratio={adapters_tps / base_tps:.3f}")
    print(f"P2_vs_naive_ratio={adapters_tps / naive_tps:.2f}")
    print(f"P3_activate_to_first_token_s={max(first_token_s) if first_token_s else float('nan'):.3f}")
    print(f"P3_activate_to_first_token_median_s={statistics.median(first_token_s) if first_token_s else float('nan'):.3f}")
    print(f"P3_failed_requests={len(failures)}")
    print(f"M1_memory_ratio={m1:.3f}")


if __name__ == "__main__":
    main()
