"""Build the offline demo chat model: tokenizer, Qwen2 weights, generation config.

    from serving.demo_model import DemoModelConfig, build_demo_model
    build_demo_model(Path("var/models/demo-chat"))            # ~minutes on 2 cores
    build_demo_model(tmp / "tiny", DemoModelConfig.tiny())    # seconds, for tests

The build is deterministic (same config, same bytes) and cached: a marker file holding the config
fingerprint is written last, and the directory appears atomically by rename.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from . import corpus
from .config import DemoModelConfig
from .tokenizer import IM_END, train_tokenizer, general_english

MARKER = "demo_model_build.json"
IGNORE = -100


def is_built(output_dir: Path, config: DemoModelConfig) -> bool:
    """Whether `output_dir` holds a finished build of exactly `config`."""
    marker = Path(output_dir) / MARKER
    try:
        return json.loads(marker.read_text())["fingerprint"] == config.fingerprint()
    except (OSError, ValueError, KeyError):
        return False


def build_demo_model(output_dir: Path, config: DemoModelConfig | None = None, progress: bool = True) -> Path:
    """Build the demo model into `output_dir` unless that build is already there.

    Args:
        output_dir: final directory (Hugging Face format: config.json, model.safetensors, tokenizer).
        config: what to build; the default config when None.
        progress: show a tqdm bar while training.

    Returns:
        `output_dir`.
    """
    config = config or DemoModelConfig()
    output_dir = Path(output_dir)
    if is_built(output_dir, config):
        return output_dir
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with _lock(output_dir):
        if is_built(output_dir, config):  # another process finished it while we waited
            return output_dir
        tmp = output_dir.parent / f".{output_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _build_into(tmp, config, progress)
            _swap_in(tmp, output_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


@contextlib.contextmanager
def _lock(output_dir: Path):
    with open(output_dir.parent / f".{output_dir.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _swap_in(tmp: Path, output_dir: Path) -> None:
    old = output_dir.parent / f".{output_dir.name}.old-{os.getpid()}"
    if output_dir.exists():
        output_dir.rename(old)
    tmp.rename(output_dir)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool):
    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _build_into(out: Path, config: DemoModelConfig, progress: bool) -> None:
    started = time.monotonic()
    dialogues = corpus.training_dialogues(config.corpus_size, config.seed)
    texts = [corpus.dialogue_text(d) for d in dialogues] + general_english(config.tokenizer_english_chars)
    tokenizer = train_tokenizer(texts, config.vocab_size)
    tokenizer.model_max_length = config.max_position_embeddings
    examples = [encode_dialogue(tokenizer, d.messages, config.seq_len) for d in dialogues]
    with _torch_threads(config.threads):
        model = train_model(tokenizer, examples, config, progress)
    with _hf_progress_bars(progress):
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out)
    (out / MARKER).write_text(json.dumps({
        "fingerprint": config.fingerprint(),
        "config": asdict(config),
        "build_seconds": round(time.monotonic() - started, 1),
    }, indent=2))


def _portable_tokenizer_class(out: Path) -> None:
    # transformers 5 writes its internal "TokenizersBackend"; older readers (vLLM images) know
    # this class under its public name.
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def encode_dialogue(tokenizer: PreTrainedTokenizerFast, messages: list[dict], seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids of a ChatML dialogue and labels that train only assistant replies and their <|im_end|>.

    Each message is encoded on its own; special tokens and the newline after the role split
    pretokens anyway, so this equals encoding the rendered template in one go.
    """
    ids, labels = [], []
    end = tokenizer.convert_tokens_to_ids(IM_END)
    for m in messages:
        head = tokenizer.encode(f"<|im_start|>{m['role']}\n", add_special_tokens=False)
        body = tokenizer.encode(m["content"], add_special_tokens=False) + [end]
        tail = tokenizer.encode("\n", add_special_tokens=False)
        target = m["role"] == "assistant"
        ids += head + body + tail
        labels += [IGNORE] * len(head) + (body if target else [IGNORE] * len(body)) + [IGNORE] * len(tail)
    return ids[:seq_len], labels[:seq_len]


def model_config(tokenizer: PreTrainedTokenizerFast, config: DemoModelConfig) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def _get_lr(step: int, config: DemoModelConfig) -> float:
    # 1) linear warmup, 2) cosine decay to a tenth of the peak
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.train_steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _get_batch(examples, order: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [examples[i] for i in order]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        ids[r, : len(x)] = torch.tensor(x)
        labels[r, : len(y)] = torch.tensor(y)
        mask[r, : len(x)] = 1
    return ids, labels, mask


def _batches(examples, config: DemoModelConfig):
    """Deterministic shuffled batches of example indices, epoch after epoch.

    Within windows of 64 batches, examples are sorted by length so that a batch pads little.
    """
    rng = random.Random(config.seed + 1)
    window = 64 * config.batch_size
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        batches = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w : w + window], key=lambda i: len(examples[i][0]))
            batches += [chunk[i : i + config.batch_size] for i in range(0, len(chunk) - config.batch_size + 1, config.batch_size)]
        rng.shuffle(batches)
        yield from batches


def train_model(tokenizer, examples, config: DemoModelConfig, progress: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(model_config(tokenizer, config))
    model.generation_config = GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id, bos_token_id=None,
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))
    model.train()
    batches = _batches(examples, config)
    bar = tqdm(range(config.train_steps), desc="demo model", disable=not progress, unit="step")
    for step in bar:
        # lr for this step
        for group in opt.param_groups:
            group["lr"] = _get_lr(step, config)
        # forward / backward
        ids, labels, mask = _get_batch(examples, next(batches), tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        # clip, step, zero grads
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")  # CPU sync point, so only every 10 steps
    model.eval()
    return model
