"""Configuration of the offline demo model build."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

# Bump when the corpus, tokenizer or training code changes what a config builds.
BUILD_VERSION = 4


@dataclass
class DemoModelConfig:
    """Everything that decides the demo model's weights; same config, same files."""

    seed: int = field(default=0, metadata={"help": "Seed for data, init and data order."})
    vocab_size: int = field(default=4096, metadata={"help": "BPE vocabulary size, special tokens included."})
    # 11.0 M weights: the 4.0 M model (256 wide, 4 layers, MLP 704) could not hold a user's style
    # and its other skills at once (docs/demo_model.md, "A wider model").
    hidden_size: int = field(default=384, metadata={"help": "Model width."})
    layers: int = field(default=6, metadata={"help": "Number of transformer blocks."})
    heads: int = field(default=6, metadata={"help": "Attention heads (head_dim = hidden_size / heads)."})
    kv_heads: int = field(default=2, metadata={"help": "Key/value heads (GQA, as in Qwen2)."})
    intermediate_size: int = field(default=1024, metadata={"help": "MLP width (gate/up/down projections)."})
    max_position_embeddings: int = field(default=1024, metadata={"help": "Context length the model advertises."})
    # 3000 steps (2.4 passes over the corpus): 1000 left sums at 0.23 and styled answers fragile
    # (docs/demo_model.md, "Training longer").
    train_steps: int = field(default=3000, metadata={"help": "Optimizer steps."})
    batch_size: int = field(default=32, metadata={"help": "Dialogues per step."})
    # 3e-3 suited the 4.0 M model; the 11.0 M one learns only 0.64 of held-out questions with it, 0.88 at 1.5e-3.
    lr: float = field(default=1.5e-3, metadata={"help": "Peak AdamW learning rate (warmup, then cosine)."})
    warmup_steps: int = field(default=60, metadata={"help": "Linear warmup steps."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    seq_len: int = field(default=160, metadata={"help": "Dialogues are truncated to this many tokens."})
    corpus_size: int = field(default=40000, metadata={"help": "Synthetic training dialogues generated."})
    tokenizer_english_chars: int = field(default=3_000_000, metadata={"help": "Characters of offline English text added to BPE training."})
    threads: int = field(default=2, metadata={"help": "torch threads while training (part of the fingerprint: float sums depend on it)."})

    def __post_init__(self):
        if self.hidden_size % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden_size must divide by heads and heads by kv_heads")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len must not exceed max_position_embeddings")

    @classmethod
    def tiny(cls) -> "DemoModelConfig":
        """A real tokenizer + Qwen2 that builds in seconds on one core; replies are short, not smart."""
        return cls(vocab_size=512, hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128,
                   max_position_embeddings=512, train_steps=120, batch_size=16, lr=1e-2, warmup_steps=10,
                   seq_len=96, corpus_size=2000, tokenizer_english_chars=100_000, threads=1)

    def fingerprint(self) -> str:
        """A short hash of the config and the build code version."""
        blob = json.dumps({"build_version": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
