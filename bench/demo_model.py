"""Benchmark of the offline demo model: held-out accuracy, termination and style following.

    .venv/bin/python bench/demo_model.py                       # build (or load) the default model
    .venv/bin/python bench/demo_model.py --tiny                # the tiny test config
    .venv/bin/python bench/demo_model.py --set train_steps=300 --model-dir /tmp/dm300
    .venv/bin/python bench/demo_model.py --lora-check          # also: can LoRA learn an unseen sign-off?

Prints NAME=value lines. Greedy decoding throughout.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from serving.demo_model import DemoModelConfig, build_demo_model, is_built  # noqa: E402
from serving.demo_model.corpus import STYLES, QA, heldout_questions, is_correct, with_hint  # noqa: E402

NEW_SIGNOFF = "Cheers, Zorblat!"  # never in the corpus


def default_model_dir() -> Path:
    data_dir = Path(os.environ.get("DATA_DIR", REPO / "var"))
    return data_dir / "models" / "demo-chat"


def parse_config(args) -> DemoModelConfig:
    config = DemoModelConfig.tiny() if args.tiny else DemoModelConfig()
    changes = {}
    for item in args.set:
        key, value = item.split("=", 1)
        changes[key] = type(getattr(config, key))(value)
    return dataclasses.replace(config, **changes)


def generate(model, tok, conversations: list[list[dict]], max_new_tokens: int = 64, batch: int = 32,
             prefill: str = "") -> list[tuple[str, bool]]:
    """Greedy replies and whether each ended with <|im_end|>; prefill begins every reply (not returned)."""
    tok.padding_side = "left"
    eos = tok.eos_token_id
    results = []
    for i in range(0, len(conversations), batch):
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) + prefill
                 for c in conversations[i : i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            ended = eos in row
            row = row[: row.index(eos)] if ended else row
            results.append((tok.decode(row, skip_special_tokens=True), ended))
    return results


def accuracy(model, tok, qas: list[QA]) -> tuple[float, float, dict[str, float]]:
    replies = generate(model, tok, [[{"role": "user", "content": qa.question}] for qa in qas])
    ok = [is_correct(qa, r) for qa, (r, _) in zip(qas, replies)]
    by_cat: dict[str, list[bool]] = {}
    for qa, good in zip(qas, ok):
        by_cat.setdefault(qa.category, []).append(good)
    return (sum(ok) / len(ok), sum(e for _, e in replies) / len(replies),
            {c: sum(v) / len(v) for c, v in sorted(by_cat.items())})


def style_following(model, tok, qas: list[QA], channel: str, param_for=None) -> tuple[float, float]:
    """Share of replies that follow a requested (seen) style, and share that are still correct."""
    rng = random.Random(7)
    convs, checks = [], []
    for name in sorted(STYLES):
        style = STYLES[name]
        for qa in qas:
            param = param_for(style) if param_for else rng.choice(style.params)
            instruction = style.instruction(rng, param)
            if channel == "system":
                conv = [{"role": "system", "content": instruction}, {"role": "user", "content": qa.question}]
            else:
                conv = [{"role": "user", "content": with_hint(qa.question, instruction)}]
            convs.append(conv)
            checks.append((style, param, qa))
    replies = generate(model, tok, convs)
    follows = [s.follows(r, p) for (s, p, _), (r, _) in zip(checks, replies)]
    correct = [is_correct(qa, r) for (_, _, qa), (r, _) in zip(checks, replies)]
    return sum(follows) / len(follows), sum(correct) / len(correct)


def accuracy_when_told(model, tok, qas: list[QA], name: str, param: str = "") -> float:
    """Held-out accuracy when the system prompt asks for one style (its first wording): what a
    perfectly learned preference could keep of the plain accuracy, for this model."""
    return accuracy_under(model, tok, qas, STYLES[name].instructions[0].replace("{p}", param))


def accuracy_when_prefilled(model, tok, qas: list[QA], prefix: str, system_prompt: str) -> float:
    """Held-out accuracy when every reply is begun with prefix, as an adapter that learned the
    prefix writes it, and the base model goes on from there."""
    return accuracy_under(model, tok, qas, system_prompt, max_new_tokens=48, prefill=prefix)


def accuracy_under(model, tok, qas: list[QA], system_prompt: str, **generate_kwargs) -> float:
    """Held-out accuracy of greedy replies to qas under system_prompt."""
    replies = generate(model, tok, [[{"role": "system", "content": system_prompt},
                                     {"role": "user", "content": qa.question}] for qa in qas], **generate_kwargs)
    return sum(is_correct(qa, r) for qa, (r, _) in zip(qas, replies)) / len(qas)


def lora_check(model_dir: Path, tok, qas: list[QA], steps: int = 128, lr: float = 5e-3) -> tuple[float, float]:
    """SFT a rank-16 LoRA on 16 replies ending with an unseen sign-off; adherence before/after on new prompts."""
    from peft import LoraConfig, get_peft_model

    from serving.demo_model.build import encode_dialogue

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    train, test = qas[:16], qas[16:]
    ask = lambda qa: [{"role": "user", "content": qa.question}]  # noqa: E731
    follows = lambda m: sum(r.rstrip().endswith(NEW_SIGNOFF) for r, _ in generate(m, tok, [ask(q) for q in test])) / len(test)  # noqa: E731
    before = follows(model)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    examples = [encode_dialogue(tok, ask(qa) + [{"role": "assistant", "content": f"{qa.answer}\n{NEW_SIGNOFF}"}], 256) for qa in train]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for step in range(steps):
        ids, labels = examples[step % len(examples)]
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return before, follows(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="override a DemoModelConfig field, e.g. train_steps=300")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--style-questions", type=int, default=10, help="held-out questions per style and channel")
    parser.add_argument("--lora-check", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    config = parse_config(args)
    model_dir = args.model_dir or default_model_dir()

    cached = is_built(model_dir, config)
    started = time.monotonic()
    build_demo_model(model_dir, config, progress=not args.no_progress)
    if not cached:
        print(f"demo_build_s={time.monotonic() - started:.0f}")
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    print(f"demo_params_m={sum(p.numel() for p in model.parameters()) / 1e6:.2f}")

    qas = heldout_questions(args.questions)
    acc, ended, by_cat = accuracy(model, tok, qas)
    print(f"demo_heldout_accuracy={acc:.2f}")
    print(f"demo_terminated_rate={ended:.2f}")
    for cat, value in by_cat.items():
        print(f"demo_heldout_accuracy_{cat}={value:.2f}")

    # Sums have no letters and conversions no capitals, so case styles are vacuous there: leave them out.
    style_qas = [q for q in heldout_questions(4 * args.style_questions, seed=99)
                 if q.category not in ("arithmetic", "unit")][: args.style_questions]
    for channel in ("system", "hint"):
        follow, correct = style_following(model, tok, style_qas, channel)
        print(f"demo_style_following_{channel}={follow:.2f}")
        print(f"demo_style_correct_{channel}={correct:.2f}")
    new_param = {"signoff": NEW_SIGNOFF, "prefix": "Zorblat says:"}
    follow, _ = style_following(model, tok, style_qas, "system", lambda s: new_param.get(s.name, s.params[0]))
    print(f"demo_style_following_new_text={follow:.2f}")

    # The personalization benchmark's retention questions; accuracy when told each style.
    from bench.personalization import SYSTEM_PROMPT, BenchConfig, heldout_prompts

    retention_qas = heldout_prompts(BenchConfig())["retention"]
    for name, param in (("uppercase", ""), ("lowercase", ""), ("terse", ""), ("prefix", "Answer:"),
                        ("signoff", NEW_SIGNOFF)):
        print(f"demo_accuracy_told_{name}={accuracy_when_told(model, tok, retention_qas, name, param):.3f}")
    # The same questions with the reply begun by the benchmark's prefix preferences, under its system prompt.
    for name, prefix in (("plain", ""), ("arrow", "~> "), ("answer", "Answer:")):
        print(f"demo_accuracy_prefilled_{name}={accuracy_when_prefilled(model, tok, retention_qas, prefix, SYSTEM_PROMPT):.3f}")

    if args.lora_check:
        before, after = lora_check(model_dir, tok, heldout_questions(56, seed=5))
        print(f"demo_lora_signoff_before={before:.2f}")
        print(f"demo_lora_signoff_after={after:.2f}")


if __name__ == "__main__":
    main()
