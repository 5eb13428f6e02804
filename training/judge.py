"""The LLM judge: the base model scores a reply from what the user said next.

Prompts and parsing follow OpenClaw-RL: the PRM prompt (openclaw-rl/openclaw_api_server.py,
`_build_prm_judge_prompt`, majority over m votes, ties -> 0) and the hindsight-hint prompt
(openclaw-opd/openclaw_opd_api_server.py, `_build_hint_judge_messages`, longest hint > 10 chars).
"""
import collections
import re

from django.conf import settings

from .signals import Verdict

BOXED_RE = re.compile(r"\\boxed\{([-+]?\d)\}")
HINT_RE = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)
MIN_HINT_CHARS = 10


class JudgeUnavailable(Exception):
    """No inference server answered; the caller falls back to the rules classifier."""


def prm_messages(response_text, next_state_text):
    system = (
        "You are a process reward model (PRM) evaluating an AI assistant.\n"
        "You will see the assistant's output and the subsequent user reply or environment feedback.\n"
        "Judge the quality of the assistant's output based on the feedback.\n"
        "The user may express satisfaction, dissatisfaction, or give no clear signal.\n"
        "If the user shows no clear attitude, infer from their follow-up whether the response was helpful.\n"
        "Think step-by-step, then give your final score inside \\boxed{}.\n"
        "Valid scores: \\boxed{1} (good), \\boxed{-1} (bad), \\boxed{0} (neutral or uncertain)."
    )
    user = (
        f"## Assistant output\n{response_text}\n\n"
        f"## Next state (user reply / environment feedback)\n{next_state_text}\n\n"
        "Now evaluate the assistant's output. Think, then output \\boxed{1}, \\boxed{-1}, or \\boxed{0}."
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def hint_messages(response_text, next_state_text):
    system = (
        "You are a process reward model used for hindsight hint extraction.\n"
        "You are given:\n"
        "1) The assistant response at turn t.\n"
        "2) The next state at turn t+1 (user reply or environment feedback).\n"
        "Your goal is to decide whether the next state reveals useful hindsight information\n"
        "that could have helped improve the assistant response at turn t.\n\n"
        "Output format rules (strict):\n"
        "- You MUST include exactly one final decision token: \\boxed{1} or \\boxed{-1}.\n"
        "- If and only if decision is \\boxed{1}, provide a concise, information-dense hint in 1-3 sentences,\n"
        "  wrapped between [HINT_START] and [HINT_END].\n"
        "- If decision is \\boxed{-1}, do not provide a hint block.\n"
        "- Hint must be concrete and actionable for improving the previous response."
    )
    user = (
        f"## Assistant response (turn t)\n{response_text}\n\n"
        f"## Next state (turn t+1)\n{next_state_text}\n\n"
        "Now output your decision and (if positive) the hint in the required format."
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def parse_score(text, valid=(1, -1, 0)):
    """The last \\boxed{n} in a judge's output, or None when absent or not a valid score."""
    found = BOXED_RE.findall(text or "")
    if not found:
        return None
    value = int(found[-1])
    return value if value in valid else None


def parse_hint(text):
    found = HINT_RE.findall(text or "")
    return found[-1].strip() if found else ""


def majority_vote(scores):
    """Majority over the valid votes; no valid vote or a tie for first place -> 0."""
    valid = [s for s in scores if s is not None]
    if not valid:
        return 0
    counts = collections.Counter(valid).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return 0
    return counts[0][0]


def best_hint(votes):
    """The longest hint over 10 characters among votes that said \\boxed{1}, or ""."""
    good = [v["hint"].strip() for v in votes if v.get("score") == 1 and len((v.get("hint") or "").strip()) > MIN_HINT_CHARS]
    return max(good, key=len) if good else ""


def _ask(client, messages, params):
    from serving.client import InferenceError, InferenceUnavailable

    try:
        return client.chat_sync(messages, adapter=None, params=params).text
    except (InferenceError, InferenceUnavailable) as exc:
        raise JudgeUnavailable(str(exc)) from exc


def judge(*, response_text, next_state_text, votes=None):
    """Score a reply from the next state with m PRM votes and m hint votes on the base model.

    Returns:
        A Verdict (classifier "llm_judge") with the vote details for the review queue.
    """
    from serving.client import SamplingParams, get_client

    m = votes or getattr(settings, "TRAINING_JUDGE_VOTES", 3)
    params = SamplingParams(temperature=0.6, max_tokens=getattr(settings, "TRAINING_JUDGE_MAX_TOKENS", 512))
    client = get_client()
    prm_raw = [_ask(client, prm_messages(response_text, next_state_text), params) for _ in range(m)]
    prm_scores = [parse_score(raw) for raw in prm_raw]
    hint_raw = [_ask(client, hint_messages(response_text, next_state_text), params) for _ in range(m)]
    hint_votes = [{"score": parse_score(raw, valid=(1, -1)), "hint": parse_hint(raw)} for raw in hint_raw]
    return Verdict(
        score=int(majority_vote(prm_scores)),
        hint=best_hint(hint_votes),
        classifier="llm_judge",
        details={"prm_votes": prm_scores, "hint_votes": hint_votes},
    )
