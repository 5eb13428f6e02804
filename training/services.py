"""Operations that span training's models, chat's feedback, serving's registry and the socket.

Views, tasks and the admin call these; none of them touches the rows directly.
"""
import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from .models import AuditEvent, TrainingJob, TrainingPause, TrainingSample

logger = logging.getLogger(__name__)

SYSTEM = "system"


# Audit
# ------------------------------------------------------------------------------


def _label(user):
    return user.get_username() if user is not None else SYSTEM


def audit(*, actor, action, subject_user_id=None, agent_id=None, target=None, reason="", before=None, after=None):
    """Append one event to the audit log.

    Args:
        actor: the User who acted, or None for the system (a task, a policy).
        action: a short verb such as "activate", "rollback", "approve_feedback".
        target: a model instance; its class name and pk are recorded.
    Returns:
        The saved AuditEvent.
    """
    subject_label = ""
    if subject_user_id is not None:
        subject = get_user_model().objects.filter(pk=subject_user_id).only("username").first()
        subject_label = subject.get_username() if subject else AuditEvent.TOMBSTONE
    return AuditEvent.objects.create(
        actor=actor,
        actor_label=_label(actor),
        action=action,
        subject_user_id=subject_user_id,
        subject_label=subject_label,
        agent_id=agent_id,
        target_type=type(target).__name__ if target is not None else "",
        target_id=str(target.pk) if target is not None else "",
        reason=reason or "",
        before=before or {},
        after=after or {},
    )


# Pushes to the user's sockets
# ------------------------------------------------------------------------------


def user_group(user_id):
    return f"user_{user_id}"


def push_to_user(user_id, event_type, **payload):
    """Send one event to every socket of a user; never fails the caller (the push is a courtesy)."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(user_group(user_id), {"type": event_type, **payload})
    except Exception:  # Redis down: the page refreshes from the DB anyway.
        logger.warning("push %s to user %s failed", event_type, user_id, exc_info=True)


def version_payload(version):
    if version is None:
        return None
    return {"id": version.pk, "name": version.name, "number": version.number, "label": version.label}


def push_job_progress(job):
    push_to_user(
        job.user_id, "job.progress", job_id=job.pk, agent_id=job.agent_id, state=job.state, progress=job.progress
    )


# Versions
# ------------------------------------------------------------------------------


def activate(version_or_none, *, user, agent, actor, reason=""):
    """Make a version (or the base model, for None) what (user, agent) is served from.

    Hot-loads through serving, writes an audit event ("activate", "rollback" or "reset_to_base",
    with before/after) and pushes `version.activated` to the user's sockets.
    Raises serving's AdapterIntegrityError (after auditing why) when the files don't match.
    """
    from serving import services as serving_services

    before = serving_services.active_version_for(user.pk, agent.pk)
    if version_or_none is None:
        action = "reset_to_base"
    elif before is not None and version_or_none.number < before.number:
        action = "rollback"
    else:
        action = "activate"
    states = {"before": {"version": before.name if before else "base"},
              "after": {"version": version_or_none.name if version_or_none else "base"}}
    try:
        version = serving_services.activate_version(
            version_or_none, user_id=user.pk, agent_id=agent.pk, actor_label=_label(actor)
        )
    except serving_services.AdapterIntegrityError as exc:
        audit(actor=actor, action=f"{action}_failed", subject_user_id=user.pk, agent_id=agent.pk,
              target=version_or_none, reason=f"adapter integrity check failed: {exc}", **states)
        raise
    audit(actor=actor, action=action, subject_user_id=user.pk, agent_id=agent.pk, target=version_or_none,
          reason=reason, **states)
    transaction.on_commit(
        lambda: push_to_user(user.pk, "version.activated", agent_id=agent.pk, version=version_payload(version))
    )
    return version


# Review
# ------------------------------------------------------------------------------


def approve_feedback(feedback, *, reviewer, note="", reward=None, corrected_text=None):
    """Approve feedback (Fix & approve: a reward override and/or edited correction land first).

    Builds its training samples and may trigger a job. reviewer=None means the review policy.
    Returns the samples built (possibly none, e.g. an ambiguous comment).
    """
    from . import signals

    with transaction.atomic():
        feedback = type(feedback).objects.select_for_update().get(pk=feedback.pk)
        before = {"status": feedback.status, "reward_override": feedback.reward_override,
                  "corrected_text": feedback.corrected_text}
        if reward is not None:
            feedback.reward_override = float(reward)
        if corrected_text is not None:
            feedback.corrected_text = corrected_text
        feedback.status = feedback.Status.APPROVED
        feedback.reviewer = reviewer
        feedback.review_note = note or feedback.review_note
        feedback.reviewed_at = timezone.now()
        feedback.reserved_by = None
        feedback.reserved_until = None
        feedback.save()
        # Re-approving replaces the samples an earlier approval built.
        feedback.samples.filter(state=TrainingSample.State.READY).update(state=TrainingSample.State.DISCARDED)
        samples = [] if feedback.withdrawn else signals.build_samples(feedback)
        agent = feedback.turn.conversation.agent
        audit(actor=reviewer, action="approve_feedback", subject_user_id=feedback.author_id, agent_id=agent.pk,
              target=feedback, reason=note,
              before=before, after={"status": feedback.status, "reward_override": feedback.reward_override,
                                    "corrected_text": feedback.corrected_text, "samples": [s.pk for s in samples]})
    maybe_request_training(feedback.author, agent)
    return samples


def reject_feedback(feedback, *, reviewer, note):
    """Reject feedback: it never becomes a sample; samples already built are discarded."""
    with transaction.atomic():
        feedback = type(feedback).objects.select_for_update().get(pk=feedback.pk)
        before = {"status": feedback.status}
        feedback.status = feedback.Status.REJECTED
        feedback.reviewer = reviewer
        feedback.review_note = note
        feedback.reviewed_at = timezone.now()
        feedback.reserved_by = None
        feedback.reserved_until = None
        feedback.save()
        discarded = feedback.samples.filter(state=TrainingSample.State.READY).update(
            state=TrainingSample.State.DISCARDED
        )
        audit(actor=reviewer, action="reject_feedback", subject_user_id=feedback.author_id,
              agent_id=feedback.turn.conversation.agent_id, target=feedback, reason=note,
              before=before, after={"status": feedback.status, "discarded_samples": discarded})
    return feedback


def discard_feedback_samples(feedback, *, reason):
    """Withdrawn feedback: drop its ready samples (samples already in a job finish that job)."""
    discarded = feedback.samples.filter(state=TrainingSample.State.READY).update(state=TrainingSample.State.DISCARDED)
    if discarded:
        audit(actor=None, action="discard_samples", subject_user_id=feedback.author_id,
              agent_id=feedback.turn.conversation.agent_id, target=feedback, reason=reason,
              after={"discarded_samples": discarded})
    return discarded


# Jobs
# ------------------------------------------------------------------------------


def batch_size_for(agent):
    return agent.batch_size or settings.TRAIN_BATCH_SIZE


def ready_samples(user, agent):
    return TrainingSample.objects.filter(user=user, agent=agent, state=TrainingSample.State.READY)


def usable_samples(user, agent, method=None):
    """The ready samples `method` learns from: rewards for Binary RL, corrections (a*) for OPD.

    The others stay ready, for a later change of method; they never trigger a job that could
    only fail for lack of data.
    """
    samples = ready_samples(user, agent)
    method = method or agent.training_method
    if method == "binary":
        return samples.filter(reward__isnull=False)
    if method in ("opd", "offline"):
        return samples.exclude(target_text="")
    return samples


def corrections_to_replay(job, limit):
    """The newest corrections (a*) that trained the versions `job` builds on, to train again.

    Each job otherwise sees only its own few samples, and a preference taught by two corrections
    fades under the next batch. OPD is off-policy-safe (-log p(a*|c') needs no π_old), so old
    corrections can be replayed; rewards can't (their π_old is a version that is gone). Only the
    lineage of the job's parent version counts: after a rollback, the corrections that trained
    the abandoned versions are not learned again.
    """
    if limit <= 0 or job.method not in ("opd", "combined") or job.parent_version_id is None:
        return []
    lineage, version, seen = [], job.parent_version, set()
    while version is not None and version.pk not in seen and len(seen) < 1000:
        seen.add(version.pk)
        lineage.append(version.pk)
        version = version.parent
    return list(
        TrainingSample.objects.filter(user=job.user, agent=job.agent, state=TrainingSample.State.USED,
                                      job__result_version__in=lineage, target_text__gt="")
        .exclude(job=job).select_related("turn__adapter_version").order_by("-created_at", "-id")[:limit]
    )


def is_training_paused(user, agent):
    """True when staff paused this user, this agent, or this user on this agent."""
    return TrainingPause.objects.filter(
        Q(user=user, agent__isnull=True) | Q(user__isnull=True, agent=agent) | Q(user=user, agent=agent)
    ).exists()


def open_job(user, agent):
    return TrainingJob.objects.filter(user=user, agent=agent, state__in=TrainingJob.OPEN_STATES).first()


def request_training(user, agent, *, trigger, actor=None):
    """Queue a training job for (user, agent) unless one is open, training is off/paused, or
    there is nothing to learn from.

    trigger: "auto" (a batch filled), "manual" (the user's "train now"), "admin" or "offline".
    Returns the new TrainingJob, or None when nothing was queued.
    """
    from .config import TrainingConfig

    if not agent.training_enabled or is_training_paused(user, agent):
        return None
    config = TrainingConfig.from_agent(agent, offline=(trigger == "offline"))
    if not usable_samples(user, agent, config.method).exists():
        return None
    try:
        with transaction.atomic():
            job = TrainingJob.objects.create(
                user=user, agent=agent, method=config.method, trigger=trigger, config=config.to_dict()
            )
    except IntegrityError:  # one_open_job_per_user_agent: a job is already queued or running
        return None
    audit(actor=actor, action="request_training", subject_user_id=user.pk, agent_id=agent.pk, target=job,
          reason=trigger, after={"method": job.method})
    from .tasks import run_training_job

    transaction.on_commit(lambda: run_training_job.apply_async(args=[job.pk], queue="training"))
    transaction.on_commit(lambda: push_job_progress(job))
    return job


def batch_is_full(user, agent):
    """True when (user, agent)'s usable samples fill a batch of either signal: `batch_size` replies
    the user corrected, or as many replies judged by a reward alone.

    A batch is replies, not samples: one corrected reply alone yields up to four (the thumb, the
    correction's a* and its -1, the next message's -1), and a job on it would learn one example.
    The two signals fill separate batches so that a combined job carries as many corrections as an
    OPD job (thumbs up no longer start it with one or two), and a user who only gives thumbs still
    trains.
    """
    size = batch_size_for(agent)
    samples = usable_samples(user, agent)
    corrected = samples.exclude(target_text="").values("turn")
    if corrected.distinct().count() >= size:
        return True
    return samples.exclude(turn__in=corrected).values("turn").distinct().count() >= size


def maybe_request_training(user, agent):
    """Queue a job when (user, agent)'s usable samples fill a batch (`batch_is_full`)."""
    if batch_is_full(user, agent):
        return request_training(user, agent, trigger="auto")
    return None


def cancel_job(job, *, actor):
    """Cancel a queued job now, or ask a running one to stop at its next step."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.state == TrainingJob.State.QUEUED:
            job.state = TrainingJob.State.CANCELLED
            job.finished_at = timezone.now()
            job.error = f"cancelled by {_label(actor)}"
            job.save(update_fields=["state", "finished_at", "error"])
            job.samples.filter(state=TrainingSample.State.IN_JOB).update(state=TrainingSample.State.READY, job=None)
        elif job.state == TrainingJob.State.RUNNING:
            job.cancel_requested = True
            job.save(update_fields=["cancel_requested"])
        else:
            return job
        audit(actor=actor, action="cancel_job", subject_user_id=job.user_id, agent_id=job.agent_id, target=job,
              after={"state": job.state, "cancel_requested": job.cancel_requested})
    transaction.on_commit(lambda: push_job_progress(job))
    return job


def pause_training(*, user=None, agent=None, actor, reason):
    """Stop new jobs for a user, an agent, or one user on one agent (a running job finishes)."""
    pause = TrainingPause.objects.create(user=user, agent=agent, reason=reason, created_by=actor)
    audit(actor=actor, action="pause_training", subject_user_id=user.pk if user else None,
          agent_id=agent.pk if agent else None, target=pause, reason=reason)
    return pause


def resume_training(*, user=None, agent=None, actor, reason=""):
    """Lift the pauses on exactly this (user, agent) scope. Returns how many were lifted."""
    pauses = TrainingPause.objects.filter(user=user, agent=agent)
    lifted = pauses.count()
    # TrainingPause has no append-only rule; the audit log keeps the history.
    pauses.delete()
    audit(actor=actor, action="resume_training", subject_user_id=user.pk if user else None,
          agent_id=agent.pk if agent else None, reason=reason, after={"lifted": lifted})
    if user is not None and agent is not None:
        transaction.on_commit(lambda: maybe_request_training(user, agent))
    return lifted


# Personalization data
# ------------------------------------------------------------------------------


class JobRunning(Exception):
    pass


def delete_personalization(user, agent, *, actor):
    """Delete (user, agent)'s samples, jobs and adapter versions (files too); conversations stay.

    Refuses while a job runs (it would publish into the void). Files go after the commit, so a
    rolled-back request never leaves rows pointing at deleted directories.
    """
    job = open_job(user, agent)
    if job is not None and job.state == TrainingJob.State.RUNNING:
        raise JobRunning("A training job is running; cancel it and try again once it has stopped.")
    from serving.models import AdapterVersion

    versions = list(AdapterVersion.objects.for_pair(user.pk, agent.pk))
    if any(v.is_active for v in versions):
        activate(None, user=user, agent=agent, actor=actor, reason="delete personalization data")
    samples = TrainingSample.objects.filter(user=user, agent=agent)
    jobs = TrainingJob.objects.filter(user=user, agent=agent)
    before = {"samples": samples.count(), "jobs": jobs.count(), "versions": [v.name for v in versions]}
    samples.delete()
    jobs.delete()
    names = [v.name for v in versions]
    AdapterVersion.objects.filter(pk__in=[v.pk for v in versions]).delete()
    audit(actor=actor, action="delete_personalization", subject_user_id=user.pk, agent_id=agent.pk,
                   target=agent, reason="user request" if actor == user else "staff request", before=before,
                   after={"samples": 0, "jobs": 0, "versions": []})

    def remove_files():
        from serving.adapters import delete_adapter
        from serving.client import get_client

        for name in names:
            try:
                get_client().unload_adapter_sync(name)  # best effort: only memory on a replica
            except Exception:
                logger.warning("could not unload %s", name, exc_info=True)
            delete_adapter(name)

    transaction.on_commit(remove_files)
    return before
