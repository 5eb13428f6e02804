"""Prompt building and the context window.

A conversation can outgrow the model's context. We keep the agent's system prompt and the
newest turns that fit (leaving room for the reply), and report the index of the first turn we
kept so that the UI can mark where the history was cut. Token counts come from the served
model's own tokenizer and chat template, so the cut matches what the engine will see; if the
tokenizer cannot be loaded we fall back to a conservative character estimate rather than fail.
"""
import functools
import json
import logging
from dataclasses import dataclass, field

from django.conf import settings

logger = logging.getLogger(__name__)

# Roughly 3 characters per token errs on the side of cutting more, never on overflowing.
_FALLBACK_CHARS_PER_TOKEN = 3
_FALLBACK_CONTEXT = 2048


class ContextTooLong(ValueError):
    """The newest message alone does not fit in the model's context window."""

    def __init__(self, tokens, limit):
        self.tokens = tokens
        self.limit = limit
        super().__init__(
            f"This message is too long for the model's context window: it takes {tokens} tokens "
            f"and at most {limit} fit. Shorten it or split it."
        )


@dataclass
class Prompt:
    messages: list
    prompt_tokens: int
    max_tokens: int  # the reply budget, clamped so prompt + reply fits the context
    context_start_index: int | None  # Turn.index of the first kept turn; None when nothing was cut
    kept_turn_ids: list = field(default_factory=list)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@functools.lru_cache(maxsize=4)
def _config_context_length(model_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return _FALLBACK_CONTEXT


def get_tokenizer():
    """The served model's tokenizer, or None when it cannot be loaded (then we estimate)."""
    try:
        return _tokenizer(str(settings.MODEL))
    except Exception:  # a missing/odd checkpoint must not break chatting; the engine tokenizes anyway
        logger.warning("tokenizer for %s unavailable; estimating token counts", settings.MODEL, exc_info=True)
        return None


def context_length():
    """The model's real context length, or settings.MODEL_MAX_CONTEXT when set."""
    if getattr(settings, "MODEL_MAX_CONTEXT", 0):
        return int(settings.MODEL_MAX_CONTEXT)
    try:
        return _config_context_length(str(settings.MODEL))
    except Exception:
        logger.warning("config for %s unavailable; assuming %d tokens", settings.MODEL, _FALLBACK_CONTEXT)
        return _FALLBACK_CONTEXT


def count_tokens(messages, tokenizer=None):
    """Prompt tokens for `messages` with the generation prompt added, as the engine will count them."""
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
    if tokenizer is not None:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        except Exception:  # no chat template, or a template that rejects this role order
            try:
                text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
                return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
            except Exception:
                logger.warning("tokenizing the prompt failed; estimating", exc_info=True)
    chars = len(json.dumps(messages, ensure_ascii=False))
    return chars // _FALLBACK_CHARS_PER_TOKEN + 8


def system_message(agent, extra_system=()):
    parts = [p for p in [agent.system_prompt, *extra_system] if p and p.strip()]
    return {"role": "system", "content": "\n\n".join(parts)} if parts else None


def turn_message(turn):
    return {"role": turn.role, "content": turn.content}


def usable_history(turns):
    """Turns that belong in a prompt: drop failed or empty replies (they never reached the user)."""
    kept = []
    for turn in turns:
        if turn.role == "assistant" and (turn.status == "failed" or not turn.content):
            continue
        kept.append(turn)
    return kept


def check_message_fits(agent, content, *, role="user", max_tokens=None):
    """Raise ContextTooLong if system prompt + this one message leave no room for a reply."""
    limit = context_length()
    reply = _reply_budget(agent, limit, max_tokens)
    messages = [m for m in [system_message(agent), {"role": role, "content": content}] if m]
    tokens = count_tokens(messages)
    if tokens > limit - reply:
        raise ContextTooLong(tokens, max(limit - reply, 0))


def _reply_budget(agent, limit, max_tokens=None):
    wanted = max_tokens or agent.max_tokens or 256
    # Never let the reply budget eat the whole window: keep at least half for the prompt.
    return max(1, min(int(wanted), limit // 2))


def build_prompt(agent, turns, *, max_tokens=None):
    """Build the messages for a reply to the last of `turns` (the branch from the root, in order).

    Args:
        agent: the Agent (its system prompt comes first).
        turns: the branch's Turn rows, oldest first; the last is the message to answer.
        max_tokens: the wanted reply length (default: the agent's).

    Returns:
        Prompt: messages, their token count, the clamped reply budget and the cut index.

    Raises:
        ContextTooLong: the newest message alone (with the system prompt) does not fit.
    """
    tokenizer = get_tokenizer()
    limit = context_length()
    reply = _reply_budget(agent, limit, max_tokens)
    budget = limit - reply

    history = usable_history(turns)
    # Leading system turns (an API client's own system prompt) join the agent's.
    extra_system = []
    while history and history[0].role == "system":
        extra_system.append(history.pop(0).content)
    system = system_message(agent, extra_system)
    head = [system] if system else []

    def cost(start):
        return count_tokens(head + [turn_message(t) for t in history[start:]], tokenizer)

    if not history:
        tokens = count_tokens(head or [{"role": "user", "content": ""}], tokenizer)
        return Prompt(head, tokens, max(1, min(reply, limit - tokens)), None, [])

    tokens = cost(0)
    start = 0
    if tokens > budget:
        last = len(history) - 1
        if cost(last) > budget:
            raise ContextTooLong(cost(last), budget)
        # Binary search for the smallest start that fits: cost falls as start grows.
        lo, hi = 1, last
        while lo < hi:
            mid = (lo + hi) // 2
            if cost(mid) <= budget:
                hi = mid
            else:
                lo = mid + 1
        start = lo
        # Begin at a user message so the model never sees a reply without its question.
        while start < last and history[start].role != "user":
            start += 1
        tokens = cost(start)
    kept = history[start:]
    cut = kept[0].index if start > 0 else None
    return Prompt(
        messages=head + [turn_message(t) for t in kept],
        prompt_tokens=tokens,
        max_tokens=max(1, min(reply, limit - tokens)),
        context_start_index=cut,
        kept_turn_ids=[t.pk for t in kept],
    )
