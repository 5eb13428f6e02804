"""A byte-level BPE tokenizer trained locally, saved as a transformers fast tokenizer with ChatML.

The merges are learned from the dialogue corpus plus general English found offline (docstrings of
the Python standard library, read with `ast` so nothing is imported, and the licence texts under
/usr/share/common-licenses), so that words never seen in dialogues still split into sensible
subwords. Digits are split one by one, as Qwen2 does, which keeps arithmetic learnable.
"""
from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LICENSES_DIR = Path("/usr/share/common-licenses")
WORDS_FILE = Path("/usr/share/dict/words")


def _stdlib_docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def _files_text(paths) -> Iterator[str]:
    for path in paths:
        try:
            yield path.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue


def general_english(max_chars: int) -> list[str]:
    """Up to `max_chars` of general English available offline, in a deterministic order."""
    sources = []
    if WORDS_FILE.is_file():
        sources.append(_files_text([WORDS_FILE]))
    if LICENSES_DIR.is_dir():
        sources.append(_files_text(sorted(p for p in LICENSES_DIR.iterdir() if p.is_file())))
    sources.append(_stdlib_docstrings())
    texts, total = [], 0
    per_source = max_chars // len(sources)
    for source in sources:
        used = 0
        for text in source:
            text = text[: per_source - used]
            texts.append(text)
            used += len(text)
            if used >= per_source:
                break
        total += used
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on `texts` and wrap it with ChatML special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode(encode(x)) must give x back exactly
        model_max_length=1 << 30,
    )
