"""Whether a piece of feedback is approved now or held for a reviewer, and why."""
from datetime import timedelta

from django.conf import settings
from django.utils import timezone


def feedback_hold_limit_per_hour():
    """More feedback items than this from one user in an hour are held (a flood or a script)."""
    return getattr(settings, "TRAINING_HOLD_FEEDBACK_PER_HOUR", 120)


def automatic_hold_reason(feedback):
    """The reason to hold feedback whatever the agent's policy says, or "".

    - the author sent more than TRAINING_HOLD_FEEDBACK_PER_HOUR feedback items in the last hour;
    - contradictory thumbs: this author put both a thumb up and a thumb down on this reply
      within the hour (withdrawn ones count: flip-flopping is a signal worth a human look).
    """
    model = type(feedback)
    since = timezone.now() - timedelta(hours=1)
    recent = model.objects.filter(author_id=feedback.author_id, created_at__gte=since).count()
    limit = feedback_hold_limit_per_hour()
    if recent > limit:
        return f"more than {limit} feedback items in the last hour"
    if feedback.kind in model.THUMBS:
        kinds = set(
            model.objects.filter(turn_id=feedback.turn_id, author_id=feedback.author_id, kind__in=model.THUMBS,
                                 created_at__gte=since).values_list("kind", flat=True)
        )
        if len(kinds) > 1:
            return "contradictory thumbs on the same reply"
    return ""


def review_decision(feedback, agent):
    """(approve_now, hold_reason) under the agent's review policy and the automatic holds."""
    reason = automatic_hold_reason(feedback)
    if reason:
        return False, reason
    policy = agent.review_policy
    if policy == agent.ReviewPolicy.AUTO_ALL:
        return True, ""
    if policy == agent.ReviewPolicy.HOLD_ALL:
        return False, "agent policy: hold everything for review"
    if feedback.kind in type(feedback).THUMBS:
        return True, ""
    return False, "agent policy: corrections and comments are reviewed"
