"""The staff review queue: filtering, reservations, and review actions on top of the services.

A reviewer reserves an item before acting on it so that two reviewers never work the same one;
a reservation lapses after RESERVATION_TTL. Approve and reject go through
`training.services.approve_feedback` / `reject_feedback`, which build samples and audit.
"""
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from chat.models import Feedback, Turn

from . import services

RESERVATION_TTL = timedelta(minutes=10)

# The queue's "kind" filter groups both thumbs under "thumb".
KIND_FILTERS = {
    "thumb": Feedback.THUMBS,
    "thumb_up": (Feedback.Kind.THUMB_UP,),
    "thumb_down": (Feedback.Kind.THUMB_DOWN,),
    "correction": (Feedback.Kind.CORRECTION,),
    "comment": (Feedback.Kind.COMMENT,),
    "implicit": (Feedback.Kind.IMPLICIT,),
}


class ReservedByOther(Exception):
    """Another reviewer holds a live reservation on the item."""

    def __init__(self, feedback):
        self.feedback = feedback
        who = feedback.reserved_by.get_username() if feedback.reserved_by_id else "someone"
        super().__init__(f"Reserved by {who} until {feedback.reserved_until:%H:%M:%S}.")


class AlreadyReviewed(Exception):
    """The item is no longer pending (someone reviewed it since the page was loaded)."""


def review_queue(*, agent=None, user=None, kind="", status="pending", verdict="", date_from=None, date_to=None,
                 held=None):
    """Feedback to review, newest first, with what the queue page shows preloaded.

    Args:
        agent, user: an Agent / User (or their ids) to narrow to.
        kind: a key of KIND_FILTERS, or "" for all.
        status: a Feedback.Status value, or "" for all.
        verdict: a classifier verdict ("+1", "-1", "0", "hint"), or "" for all.
        date_from, date_to: dates (inclusive) on the feedback's creation.
        held: True for items with a hold reason only, False for none, None for both.
    """
    qs = Feedback.objects.select_related(
        "turn__conversation__agent", "author", "reviewer", "reserved_by"
    ).filter(withdrawn=False)
    if agent:
        qs = qs.filter(turn__conversation__agent=agent)
    if user:
        qs = qs.filter(author=user)
    if kind in KIND_FILTERS:
        qs = qs.filter(kind__in=KIND_FILTERS[kind])
    if status:
        qs = qs.filter(status=status)
    if verdict:
        qs = qs.filter(verdict=verdict)
    if date_from:
        qs = qs.filter(created_at__date__gte=date_from)
    if date_to:
        qs = qs.filter(created_at__date__lte=date_to)
    if held is True:
        qs = qs.exclude(hold_reason="")
    elif held is False:
        qs = qs.filter(hold_reason="")
    return qs.order_by("-created_at", "-id")


def is_reserved_by_other(feedback, reviewer, now=None):
    now = now or timezone.now()
    return (
        feedback.reserved_by_id is not None
        and feedback.reserved_by_id != reviewer.pk
        and feedback.reserved_until is not None
        and feedback.reserved_until > now
    )


def _lock(feedback, reviewer):
    """Re-read the row under a lock and check that `reviewer` may act on it."""
    locked = Feedback.objects.select_for_update(of=("self",)).select_related("reserved_by").get(pk=feedback.pk)
    if is_reserved_by_other(locked, reviewer):
        raise ReservedByOther(locked)
    return locked


def reserve(feedback, *, reviewer, ttl=RESERVATION_TTL):
    """Reserve an item for `reviewer` (renewing their own reservation). Raises ReservedByOther."""
    with transaction.atomic():
        locked = _lock(feedback, reviewer)
        locked.reserved_by = reviewer
        locked.reserved_until = timezone.now() + ttl
        locked.save(update_fields=["reserved_by", "reserved_until", "updated_at"])
    return locked


def release(feedback, *, reviewer):
    """Drop `reviewer`'s own reservation; a no-op for anyone else's."""
    with transaction.atomic():
        locked = Feedback.objects.select_for_update().get(pk=feedback.pk)
        if locked.reserved_by_id == reviewer.pk:
            locked.reserved_by = None
            locked.reserved_until = None
            locked.save(update_fields=["reserved_by", "reserved_until", "updated_at"])
    return locked


def approve(feedback, *, reviewer, note="", reward=None, corrected_text=None):
    """Approve (or, with reward / corrected_text, fix & approve) one item. Returns its samples.

    Raises ReservedByOther when another reviewer holds it, AlreadyReviewed when it isn't pending.
    """
    with transaction.atomic():
        locked = _lock(feedback, reviewer)
        if locked.status != Feedback.Status.PENDING:
            raise AlreadyReviewed(f"Feedback {locked.pk} is already {locked.get_status_display().lower()}.")
        return services.approve_feedback(
            locked, reviewer=reviewer, note=note, reward=reward, corrected_text=corrected_text
        )


def reject(feedback, *, reviewer, note):
    """Reject one item with a note. Raises ReservedByOther or AlreadyReviewed."""
    with transaction.atomic():
        locked = _lock(feedback, reviewer)
        if locked.status != Feedback.Status.PENDING:
            raise AlreadyReviewed(f"Feedback {locked.pk} is already {locked.get_status_display().lower()}.")
        return services.reject_feedback(locked, reviewer=reviewer, note=note)


def _bulk(action, ids, **kwargs):
    done, skipped = [], []
    for feedback in Feedback.objects.filter(pk__in=ids).order_by("pk"):
        try:
            action(feedback, **kwargs)
        except (ReservedByOther, AlreadyReviewed) as exc:
            skipped.append((feedback.pk, str(exc)))
        else:
            done.append(feedback.pk)
    return done, skipped


def bulk_approve(ids, *, reviewer, note=""):
    """Approve many items; items reserved by others or already reviewed are skipped.

    Returns (approved ids, [(skipped id, why), ...]).
    """
    return _bulk(approve, ids, reviewer=reviewer, note=note)


def bulk_reject(ids, *, reviewer, note):
    """Reject many items with one note; returns (rejected ids, [(skipped id, why), ...])."""
    return _bulk(reject, ids, reviewer=reviewer, note=note)


def conversation_context(feedback, *, limit=20):
    """The shown branch up to the reviewed reply (oldest first), at most `limit` turns.

    Follows parent links rather than indexes, so a regenerated sibling never leaks in.
    """
    chain = []
    turn = feedback.turn
    while turn is not None and len(chain) < limit:
        chain.append(turn)
        turn = Turn.objects.filter(pk=turn.parent_id).first() if turn.parent_id else None
    chain.reverse()
    if chain and chain[0].parent_id is None and chain[0].index > 0 and len(chain) < limit:
        # Turns stored without parent links: take the latest turn at each earlier index.
        earlier = {}
        for t in Turn.objects.filter(conversation_id=feedback.turn.conversation_id, index__lt=chain[0].index):
            earlier[t.index] = t  # ordering is (index, created_at, id): the last one wins
        chain = [earlier[i] for i in sorted(earlier)][-(limit - len(chain)):] + chain
    return chain


# Behaviour diff: a version's replies to the agent's probe prompts
# ------------------------------------------------------------------------------

PROBE_CACHE_SECONDS = 7 * 24 * 3600
PROBE_MAX_TOKENS = 128


def probe_messages(agent, prompt):
    """The messages a probe prompt is sent as (the agent's system prompt first, if any)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("content") or prompt.get("prompt") or ""
    messages = [{"role": "system", "content": agent.system_prompt}] if agent.system_prompt else []
    return messages + [{"role": "user", "content": str(prompt)}]


def _probe_cache_key(version, messages):
    import hashlib
    import json

    if version is None:
        from serving import services as serving_services

        name, config_hash = serving_services.base_model_identity()
        who = f"base:{config_hash or name}"
    else:
        who = f"{version.name}:{version.sha256[:16]}"
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:32]
    return f"training:probe:{who}:{digest}"


def _generate(client, messages, version, params):
    # The client reloads an evicted or never-loaded version itself (sha256-verified) and retries.
    adapter = version.name if version is not None else None
    return client.chat_sync(messages, adapter=adapter, params=params).text


def probe_replies(version, agent):
    """Greedy replies of `version` (None: the base model) to each of the agent's probe prompts.

    Computed on demand through serving and cached per (version, exact messages), so a second look
    at a diff costs nothing. A prompt whose reply couldn't be made gets an "error" instead.
    Returns [{"prompt", "reply" | None, "error" | None}, ...].
    """
    from django.core.cache import cache
    from serving.client import SamplingParams, get_client

    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=min(agent.max_tokens, PROBE_MAX_TOKENS), seed=0)
    results, client = [], None
    for prompt in agent.probe_prompts or []:
        messages = probe_messages(agent, prompt)
        text = messages[-1]["content"]
        key = _probe_cache_key(version, messages)
        reply = cache.get(key)
        error = None
        if reply is None:
            try:
                client = client or get_client()
                reply = _generate(client, messages, version, params)
            except Exception as exc:  # serving down, adapter missing: show it, don't 500 the page
                reply, error = None, f"{type(exc).__name__}: {exc}"
            else:
                cache.set(key, reply, PROBE_CACHE_SECONDS)
        results.append({"prompt": text, "reply": reply, "error": error})
    return results


def behaviour_diff(version, agent):
    """Rows comparing `version` with the newest older version whose files exist (or base).

    Returns (previous version or None, [{"prompt", "before", "after", "changed", "error"}]).
    """
    from serving.models import AdapterVersion

    previous = (
        AdapterVersion.objects.for_pair(version.user_id, version.agent_id)
        .filter(number__lt=version.number, state=AdapterVersion.State.READY).order_by("-number").first()
    )
    after = probe_replies(version, agent)
    before = probe_replies(previous, agent)
    rows = []
    for old, new in zip(before, after):
        rows.append({
            "prompt": new["prompt"],
            "before": old["reply"],
            "after": new["reply"],
            "changed": old["reply"] != new["reply"],
            "error": new["error"] or old["error"],
        })
    return previous, rows
