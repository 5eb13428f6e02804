"""Approved training samples as JSONL, for offline training with TRL or anything else.

One JSON object per line (the shape is documented in docs/review.md):

    {"messages": [...context..., {"role": "assistant", "content": <target>}],
     "prompt": [...context...], "completion": [{"role": "assistant", "content": <target>}],
     "reward": 1.0 | -1.0 | null, "correction": str | null, "hint": str | null,
     "reply": <the model's original reply>, ...provenance...}

`messages` is TRL's conversational (SFT) format and `prompt`/`completion` its conversational
prompt-completion format. The target is the correction a* when there is one, else the reply.
"""
import json

from django.db.models import Q

from chat.models import Feedback

from .models import TrainingSample

SCHEMA_VERSION = 1


def approved_samples(*, agent=None, user=None, date_from=None, date_to=None):
    """Samples built from approved, live feedback (discarded ones left out), oldest first."""
    qs = (
        TrainingSample.objects.select_related("feedback", "turn", "agent", "turn__adapter_version")
        .filter(feedback__status=Feedback.Status.APPROVED, feedback__withdrawn=False)
        .filter(~Q(state=TrainingSample.State.DISCARDED))
    )
    if agent:
        qs = qs.filter(agent=agent)
    if user:
        qs = qs.filter(user=user)
    if date_from:
        qs = qs.filter(created_at__date__gte=date_from)
    if date_to:
        qs = qs.filter(created_at__date__lte=date_to)
    return qs.order_by("created_at", "id")


def _clean_messages(messages):
    return [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in messages or []]


def sample_record(sample):
    """One exportable dict for a TrainingSample."""
    context = _clean_messages(sample.context_messages)
    reply = sample.turn.content
    target = sample.target_text or reply
    completion = [{"role": "assistant", "content": target}]
    feedback = sample.feedback
    return {
        "messages": context + completion,
        "prompt": context,
        "completion": completion,
        "reward": sample.reward,
        "correction": sample.target_text or None,
        "hint": sample.hint or None,
        "reply": reply,
        "enhanced_prompt": _clean_messages(sample.enhanced_messages) or None,
        # Provenance
        "schema_version": SCHEMA_VERSION,
        "sample_id": sample.pk,
        "sample_state": sample.state,
        "feedback_id": feedback.pk,
        "feedback_kind": feedback.kind,
        "verdict": feedback.verdict or None,
        "reviewer_id": feedback.reviewer_id,
        "reviewed_at": feedback.reviewed_at.isoformat() if feedback.reviewed_at else None,
        "classifier": sample.classifier,
        "user_id": sample.user_id,
        "agent_id": sample.agent_id,
        "agent_slug": sample.agent.slug,
        "turn_id": sample.turn_id,
        "conversation_id": sample.turn.conversation_id,
        "adapter": sample.turn.adapter_name or "base",
        "created_at": sample.created_at.isoformat(),
        "provenance": sample.provenance,
    }


def iter_jsonl(samples):
    """Yield one JSONL line (with its newline) per sample; streams, for big exports."""
    for sample in samples.iterator(chunk_size=500):
        yield json.dumps(sample_record(sample), ensure_ascii=False) + "\n"
