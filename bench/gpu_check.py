"""GPU checks of the built-in engine and the trainer (run on a CUDA machine; no Django needed).

    python bench/gpu_check.py --model DIR [--adapters 16] [--tokens 64]

1. Engine parity on CUDA: greedy text of the batched-LoRA engine (float32) equals peft's own
   single-adapter generate, for several adapters, alone and in one mixed batch.
2. Engine throughput on CUDA (bfloat16): 16 concurrent streams on 16 adapters vs 16 on base.
3. Trainer on CUDA vs CPU: one combined (PPO + OPD) job on the same examples; log p(a*) must rise
   on both, and the wall-time ratio is reported.
Prints NAME=value lines.
"""
import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from serving.engine.engine import Engine  # noqa: E402
from serving.engine.testing import make_peft_adapter  # noqa: E402
from serving.protocol import SamplingParams  # noqa: E402

PROMPTS = ["What is the capital of France?", "What is 7 plus 5?", "How do I list files in a folder?",
           "Define a noun.", "Hello! How are you?", "Convert 3 meters to centimeters."]


def peft_greedy(model_dir, adapter_dir, prompt_ids, max_tokens, device):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=base.generation_config.eos_token_id, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


async def engine_run(engine, requests, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = await asyncio.gather(*(engine.complete(ids, params, adapter=name) for ids, name in requests))
    return [list(ids) for _, ids, _, _ in outs]


def trim_eos(ids, eos):
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def check_parity(model_dir, adapters, max_tokens, device):
    engine = Engine(model_dir, device=device, max_loras=len(adapters), dtype=torch.float32)
    engine.start()
    try:
        names = [f"a{i}" for i in range(len(adapters))]
        loop = asyncio.new_event_loop()
        for name, path in zip(names, adapters):
            loop.run_until_complete(engine.add_adapter(name, str(path)))
        prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        requests = [(prompts[i % len(prompts)], names[i]) for i in range(len(names))]
        mixed = loop.run_until_complete(engine_run(engine, requests, max_tokens))
        alone = [loop.run_until_complete(engine_run(engine, [r], max_tokens))[0] for r in requests]
        eos = min(engine.eos_token_ids) if engine.eos_token_ids else None
        reference = [peft_greedy(model_dir, adapters[i], requests[i][0], max_tokens, device) for i in range(4)]
        loop.close()
    finally:
        engine.shutdown()
    mixed_vs_alone = sum(m == a for m, a in zip(mixed, alone)) / len(mixed)
    vs_peft = sum(trim_eos(alone[i], eos) == trim_eos(reference[i], eos) for i in range(4)) / 4
    return {"gpu_mixed_equals_alone": mixed_vs_alone, "gpu_engine_equals_peft": vs_peft}


def throughput(model_dir, adapters, max_tokens, device):
    engine = Engine(model_dir, device=device, max_loras=len(adapters))
    engine.start()
    loop = asyncio.new_event_loop()
    try:
        names = [f"t{i}" for i in range(len(adapters))]
        for name, path in zip(names, adapters):
            loop.run_until_complete(engine.add_adapter(name, str(path)))
        prompt = engine.render_chat([{"role": "user", "content": PROMPTS[0]}])
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0, ignore_eos=True)

        async def wave(adapter_names):
            outs = await asyncio.gather(*(engine.complete(prompt, params, adapter=n) for n in adapter_names))
            return sum(len(ids) for _, ids, _, _ in outs)

        loop.run_until_complete(wave([None] * 4 + names))  # warm-up: kernels, adapter slots
        rates = {}
        for label, wave_names in (("base", [None] * len(names)), ("adapters", names)):
            start = time.perf_counter()
            tokens = loop.run_until_complete(wave(wave_names))
            rates[label] = tokens / (time.perf_counter() - start)
    finally:
        loop.close()
        engine.shutdown()
    return {"gpu_base_tokens_per_s": round(rates["base"], 1), "gpu_adapters_tokens_per_s": round(rates["adapters"], 1),
            "gpu_P1_adapters_vs_base_ratio": round(rates["adapters"] / rates["base"], 3)}


def training_examples(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.trainer import Example

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = []
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
            response = out[0, len(prompt_ids):].tolist()
            logits = model(out).logits[0, len(prompt_ids) - 1:-1]
            old = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
        examples.append(Example(kind="eval", sample_id=i, prompt_ids=prompt_ids, response_ids=response,
                                old_logprobs=old, reward=-1.0))
        hinted = [{"role": "user", "content": f"{prompt}\n\n[user's hint / instruction]\nSign off with Cheers, Zorblat!"}]
        examples.append(Example(kind="directive", sample_id=100 + i, messages=hinted,
                                target_text=f"{tokenizer.decode(response, skip_special_tokens=True)} Cheers, Zorblat!"))
    return examples


def check_training(model_dir, device):
    from training.config import TrainingConfig
    from training.trainer import train

    examples = training_examples(model_dir)
    config = TrainingConfig(method="combined", steps_per_job=8)
    figures = {}
    for device in dict.fromkeys((device, "cpu")):
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            metrics = train(config, examples, base_model_path=str(model_dir), init_adapter_dir=None, out_dir=out,
                            served_model_name="base", device=device)
            figures[f"{device}_job_s"] = round(time.perf_counter() - start, 2)
            figures[f"{device}_logp_target_gain"] = round(metrics["logp_target_after"] - metrics["logp_target_before"], 4)
    if "cuda_job_s" in figures:
        figures["cpu_vs_cuda_job_time_ratio"] = round(figures["cpu_job_s"] / figures["cuda_job_s"], 2)
    return {f"gpu_train_{k}": v for k, v in figures.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        print(f"gpu_name={torch.cuda.get_device_name(0)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [make_peft_adapter(args.model, Path(tmp) / f"a{i}", rank=16, seed=i) for i in range(args.adapters)]
        for step in (lambda: check_parity(args.model, adapters[:8], 32, args.device),
                     lambda: throughput(args.model, adapters, args.tokens, args.device),
                     lambda: check_training(args.model, args.device)):
            try:
                for name, value in step().items():
                    print(f"{name}={value}", flush=True)
            except Exception as exc:  # report and go on: one device lease, every figure we can get
                print(f"gpu_check_error={type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
