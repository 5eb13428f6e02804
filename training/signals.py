"""From feedback to training samples: the rules classifier (English and Korean), the context
snapshot c, the hint-enhanced context c' and the samples themselves.

The split follows OpenClaw-RL: an *evaluative* signal (+1 / -1) trains Binary RL (PPO) on the
reply as sampled; a *directive* signal (a corrected reply a*, or a hint) trains hindsight
on-policy distillation with the hint appended to the last user message of c (c').
"""
import re
from dataclasses import dataclass, field

from django.db import transaction
from django.utils import timezone

from .models import TrainingSample

# OpenClaw-RL (openclaw-opd/openclaw_opd_api_server.py, _append_hint_to_messages) appends the
# hint to the last user message under this exact marker line.
HINT_MARKER = "[user's hint / instruction]"


# Verdicts
# ------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What a classifier read in a message that followed a reply.

    score: +1 (the user moved on / thanked), -1 (redo, "no, I meant", complaint), 0 (ambiguous).
    hint: a directive the reply should have followed ("use ls -l", "shorter please"), or "".
    """

    score: int = 0
    hint: str = ""
    classifier: str = "rules"
    details: dict = field(default_factory=dict)

    @property
    def label(self):
        """The short form stored on Feedback.verdict: "+1", "-1", "0", "hint", "-1+hint"."""
        parts = [] if (self.score == 0 and self.hint) else [f"{self.score:+d}" if self.score else "0"]
        if self.hint:
            parts.append("hint")
        return "+".join(parts)


# Rules classifier
# ------------------------------------------------------------------------------
# Patterns are searched in the lower-cased message. Korean has no word boundaries that \b
# understands well, so its patterns are plain stems.

_POSITIVE = [
    r"\bthanks?\b", r"\bthank you\b", r"\bthx\b", r"\bty\b", r"\bperfect\b", r"\bgreat\b", r"\bawesome\b",
    r"\bexcellent\b", r"\bnice\b", r"\bexactly\b", r"\bthat works\b", r"\bit works\b", r"\bworked\b",
    r"\bgood job\b", r"\bwell done\b", r"\blooks good\b", r"\bthat'?s right\b", r"\bcorrect\b",
    r"\bnot bad\b", r"\bgot it\b", r"\bcool\b", r"\blove it\b", r"👍", r"🙏",
    "고마워", "고맙", "감사", "완벽", "좋아요", "좋아", "좋네", "좋습니다", "잘했", "잘 했", "맞아", "맞습니다",
    "정확", "최고", "훌륭", "됐어", "됐다", "됐네", "굿",
]
_NEGATIVE = [
    r"^\s*no\b", r"^\s*nope\b", r"\bwrong\b", r"\bincorrect\b", r"\bthat'?s not\b", r"\bthis is not\b",
    r"\bnot what i\b", r"\bi meant\b", r"\bi said\b", r"\bredo\b", r"\btry again\b", r"\bagain\b",
    r"\bdoesn'?t work\b", r"\bdidn'?t work\b", r"\bdoes not work\b", r"\bnot working\b", r"\bstill\b.*\b(broken|wrong|fails?)\b",
    r"\byou missed\b", r"\byou forgot\b", r"\buseless\b", r"\bterrible\b", r"\bawful\b", r"\bbad\b", r"\bwtf\b",
    r"\bmakes no sense\b", r"\bnot helpful\b", r"\bunhelpful\b", r"\bwhy did you\b", r"\bi asked\b",
    r"\brephrase\b", r"\bmistake\b", r"\berror\b", r"👎",
    "아니", "틀렸", "틀려", "틀린", "잘못", "다시", "그게 아니", "내 말은", "내말은", "안 돼", "안돼", "안 되", "안되",
    "별로", "이상해", "이상하", "엉망", "쓸모없", "실수", "오류", "에러", "왜 그랬",
]
# "no problem" / "not bad" are not complaints.
_NOT_NEGATIVE = [r"\bno problem\b", r"\bno worries\b", r"\bnot bad\b", r"\bno,? thanks?\b.*\b(fine|good|great)\b"]
_DIRECTIVE = [
    r"\b(please |pls )?(use|try|add|remove|include|avoid|prefer|write|make it|keep it|format|answer in|reply in|respond in|explain|show|give me|call|run|put|switch to)\b",
    r"\bdon'?t\b", r"\bdo not\b", r"\binstead\b", r"\bshould\b", r"\bnext time\b", r"\bwithout\b",
    r"\b(shorter|longer|briefer|simpler|more concise|more detail|more detailed|less verbose|step by step)\b",
    r"\bin (english|korean|french|german|spanish|japanese|chinese|python|bash|json|markdown|bullet points?)\b",
    r"\bplease\b",
    "해줘", "해 줘", "해주세요", "해 주세요", "하세요", "하지 마", "하지마", "쓰지 마", "쓰지마", "써줘", "써 줘", "사용해",
    "짧게", "간단히", "간결", "자세히", "길게", "대신", "말고", "으로 해", "로 해", "부탁",
]
# Leading words that carry the verdict, not the instruction: "no, use ls -l" -> "use ls -l".
_LEADING_FILLER = re.compile(r"^\s*(no+|nope|wrong|thanks?|thank you|ok(ay)?|great|perfect|아니(요|야)?|고마워|감사합니다)[\s,.!:;-]*", re.I)


def _matches(patterns, text):
    return [p for p in patterns if re.search(p, text)]


def _sentences(text):
    return [s.strip() for s in re.split(r"(?<=[.!?。])\s+|\n+", text) if s.strip()]


def classify_rules(text):
    """Classify the message that followed a reply with the English/Korean pattern set.

    Returns:
        A Verdict: score +1/-1/0 and the directive hint (the sentences that instruct), if any.
    """
    lowered = (text or "").strip().lower()
    if not lowered:
        return Verdict(details={"reason": "empty"})
    negatives_masked = lowered
    for pattern in _NOT_NEGATIVE:
        negatives_masked = re.sub(pattern, " ", negatives_masked)
    pos = _matches(_POSITIVE, lowered)
    neg = _matches(_NEGATIVE, negatives_masked)
    score = 0
    if neg and not pos:
        score = -1
    elif pos and not neg:
        score = 1
    elif pos and neg:
        # "thanks, but that's wrong": the complaint decides; a lone polite word doesn't cancel it.
        score = -1 if len(neg) >= len(pos) else 0
    hint_sentences = []
    for sentence in _sentences(text):
        if _matches(_DIRECTIVE, sentence.lower()):
            cleaned = _LEADING_FILLER.sub("", sentence).strip()
            if cleaned:
                hint_sentences.append(cleaned)
    hint = " ".join(hint_sentences)
    return Verdict(score=score, hint=hint, classifier="rules", details={"positive": pos, "negative": neg})


def classify(agent, text, *, response_text=""):
    """Run the agent's classifier; the LLM judge falls back to the rules when it can't answer."""
    if agent.classifier == agent.Classifier.LLM_JUDGE:
        from . import judge

        try:
            return judge.judge(response_text=response_text, next_state_text=text)
        except judge.JudgeUnavailable as exc:
            verdict = classify_rules(text)
            verdict.details["judge_error"] = str(exc)
            verdict.classifier = "rules"
            return verdict
    return classify_rules(text)


# Context snapshots
# ------------------------------------------------------------------------------


def context_for_turn(turn):
    """c: the messages an assistant turn answered, as chat built them (chat.context.build_prompt):
    the agent's system prompt joined with leading system turns, then the usable history of the
    turn's branch from the first turn that fit the context window (context_start_index).
    """
    from chat import context as chat_context

    chain = []
    node = turn.parent
    while node is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    history = chat_context.usable_history(chain)
    extra_system = []
    while history and history[0].role == "system":
        extra_system.append(history.pop(0).content)
    system = chat_context.system_message(turn.conversation.agent, extra_system)
    if turn.context_start_index is not None:
        history = [t for t in history if t.index >= turn.context_start_index]
    return ([system] if system else []) + [chat_context.turn_message(t) for t in history]


def append_hint(messages, hint):
    """c': a copy of c with the hint appended to the last user message under HINT_MARKER."""
    cloned = [dict(m) for m in messages]
    hint = (hint or "").strip()
    if not hint:
        return cloned
    if not cloned:
        return [{"role": "user", "content": f"{HINT_MARKER}\n{hint}"}]
    target = next((i for i in range(len(cloned) - 1, -1, -1) if cloned[i]["role"] == "user"), len(cloned) - 1)
    cloned[target]["content"] = (f"{cloned[target].get('content') or ''}\n\n{HINT_MARKER}\n{hint}").strip()
    return cloned


# Samples
# ------------------------------------------------------------------------------


def build_samples(feedback):
    """Turn approved feedback into TrainingSample rows (state ready).

    thumbs -> one evaluative sample (±1); correction -> a directive sample (a*, c') and an
    evaluative -1 on the original reply; comment / implicit -> what the classifier found:
    ±1 evaluative, and a hint-only directive sample (used by opd_mode=teacher). A reviewer's
    reward override replaces the score (0 means: no evaluative sample).
    Returns the samples created.
    """
    from .models import Judgement

    turn = feedback.turn
    agent = turn.conversation.agent
    judgement = Judgement.objects.filter(feedback=feedback).first()
    context = context_for_turn(turn)
    classifier = judgement.classifier if judgement else "explicit"
    provenance = {
        "feedback_id": feedback.pk,
        "feedback_kind": feedback.kind,
        "classifier": classifier,
        "classified_at": (judgement.created_at if judgement else feedback.created_at).isoformat(),
        "built_at": timezone.now().isoformat(),
        "verdict": feedback.verdict,
        "turn_id": turn.pk,
        "adapter": turn.adapter_name or "base",
        "adapter_version_id": turn.adapter_version_id,
        "reviewer_id": feedback.reviewer_id,
        "reward_override": feedback.reward_override,
    }
    if feedback.reward_override is not None:
        score = feedback.reward_override
    elif feedback.kind == feedback.Kind.THUMB_UP:
        score = 1.0
    elif feedback.kind in (feedback.Kind.THUMB_DOWN, feedback.Kind.CORRECTION):
        score = -1.0
    else:
        score = float(judgement.score) if judgement else 0.0
    if feedback.kind == feedback.Kind.CORRECTION:
        hint = (feedback.comment or feedback.reason or "").strip()
    else:
        hint = judgement.hint if judgement else ""

    common = dict(user_id=feedback.author_id, agent=agent, feedback=feedback, turn=turn,
                  context_messages=context, classifier=classifier)
    samples = []
    with transaction.atomic():
        if score:
            samples.append(TrainingSample.objects.create(
                reward=float(score), provenance={**provenance, "signal": "evaluative"}, **common))
        if feedback.kind == feedback.Kind.CORRECTION and feedback.corrected_text.strip():
            samples.append(TrainingSample.objects.create(
                target_text=feedback.corrected_text, hint=hint, enhanced_messages=append_hint(context, hint),
                provenance={**provenance, "signal": "directive"}, **common))
        elif hint:
            samples.append(TrainingSample.objects.create(
                hint=hint, enhanced_messages=append_hint(context, hint),
                provenance={**provenance, "signal": "hint"}, **common))
    return samples


# Receiver (wired in TrainingConfig.ready)
# ------------------------------------------------------------------------------


def feedback_saved(sender, instance, created, update_fields=None, **kwargs):
    """New or withdrawn feedback -> process_feedback on the `default` queue, after the commit,
    so the judge never blocks chat. Training's own saves (verdict, review) don't re-enqueue."""
    withdrawn_now = instance.withdrawn and (update_fields is None or "withdrawn" in update_fields)
    if not (created or withdrawn_now):
        return
    from .tasks import process_feedback

    feedback_id = instance.pk
    # Robust: the feedback is committed; if the broker is down, the periodic sweep queues it later.
    transaction.on_commit(lambda: process_feedback.apply_async(args=[feedback_id], queue="default"), robust=True)
