"""Celery tasks: feedback processing (queue `default`) and training jobs (queue `training`).

Arguments are ids; each task fetches its rows again. Training jobs are idempotent by job id
(staging dir keyed by the job id, the version row unique per job via result_version), so a
job redelivered after a worker crash (acks_late + reject_on_worker_lost) publishes once.
"""
import logging
import shutil
from datetime import timedelta
from pathlib import Path

from celery import shared_task
from celery.signals import celeryd_after_setup, worker_ready
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Max, OuterRef, Subquery
from django.utils import timezone

from . import services
from .models import Judgement, TrainingJob, TrainingSample

logger = logging.getLogger(__name__)


# Feedback
# ------------------------------------------------------------------------------


@shared_task(acks_late=True)
def process_feedback(feedback_id):
    """Classify comments and next-state messages, then approve now or hold for review."""
    from chat.models import Feedback

    with transaction.atomic():
        # The row lock makes a duplicate delivery (the periodic sweep) wait, then see it processed.
        feedback = (Feedback.objects.select_for_update(of=("self",)).select_related("turn__conversation__agent")
                    .filter(pk=feedback_id).first())
        if feedback is None:
            return "missing"
        return _process_feedback(feedback)


def _process_feedback(feedback):
    from chat.models import Feedback

    from . import policy, signals

    if feedback.withdrawn:
        services.discard_feedback_samples(feedback, reason="feedback withdrawn")
        return "withdrawn"
    if feedback.verdict or feedback.status != Feedback.Status.PENDING or feedback.hold_reason:
        return "already processed"
    agent = feedback.turn.conversation.agent

    if feedback.kind in (Feedback.Kind.COMMENT, Feedback.Kind.IMPLICIT):
        text = feedback.comment if feedback.kind == Feedback.Kind.COMMENT else (
            feedback.next_turn.content if feedback.next_turn_id else feedback.comment)
        verdict = signals.classify(agent, text, response_text=feedback.turn.content)
        Judgement.objects.update_or_create(feedback=feedback, defaults=dict(
            classifier=verdict.classifier, score=verdict.score, hint=verdict.hint, details=verdict.details))
        feedback.verdict = verdict.label
        if feedback.kind == Feedback.Kind.IMPLICIT and verdict.score == 0 and not verdict.hint:
            # An ordinary follow-up message carries no signal; keep it out of the review queue.
            feedback.status = Feedback.Status.REJECTED
            feedback.review_note = "classifier found no signal (0)"
            feedback.reviewed_at = timezone.now()
            feedback.save(update_fields=["verdict", "status", "review_note", "reviewed_at", "updated_at"])
            return "no signal"
    elif feedback.kind == Feedback.Kind.CORRECTION:
        feedback.verdict = "correction"
    else:
        feedback.verdict = "+1" if feedback.kind == Feedback.Kind.THUMB_UP else "-1"
    feedback.save(update_fields=["verdict", "updated_at"])

    approve, hold_reason = policy.review_decision(feedback, agent)
    if approve:
        services.approve_feedback(feedback, reviewer=None, note=f"auto-approved ({agent.review_policy})")
        return "approved"
    feedback.hold_reason = hold_reason
    feedback.save(update_fields=["hold_reason", "updated_at"])
    services.audit(actor=None, action="hold_feedback", subject_user_id=feedback.author_id, agent_id=agent.pk,
                   target=feedback, reason=hold_reason)
    return "held"


@shared_task
def requeue_unprocessed_feedback(older_than_s=60):
    """Queue feedback that was committed while the broker was unreachable (its hand-off failed).

    process_feedback is idempotent, so feedback queued twice is processed once.
    """
    from chat.models import Feedback

    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    stale = Feedback.objects.filter(status=Feedback.Status.PENDING, verdict="", hold_reason="", withdrawn=False,
                                    created_at__lt=cutoff).values_list("pk", flat=True)
    for feedback_id in stale:
        process_feedback.apply_async(args=[feedback_id], queue="default")
    return len(stale)



# Training jobs
# ------------------------------------------------------------------------------


def staging_dir(job_id):
    """Where a job writes its adapter before publishing; keyed by job id, so a rerun overwrites."""
    return Path(settings.ADAPTER_ROOT) / ".staging" / f"job-{job_id}"


def next_queued_job():
    """The queued job of the user served least recently (never served first), oldest first.

    Fair scheduling: one heavy user with many queued jobs (on many agents) takes turns with
    everyone else instead of holding the training queue in FIFO order.
    """
    last_served = (
        TrainingJob.objects.filter(user=OuterRef("user"), started_at__isnull=False)
        .values("user").annotate(last=Max("started_at")).values("last")
    )
    return (
        TrainingJob.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(state=TrainingJob.State.QUEUED)
        .annotate(last_served=Subquery(last_served))
        .order_by(F("last_served").asc(nulls_first=True), "created_at", "id")
        .first()
    )


def claim_job(job_id):
    """Pick the job this delivery runs. Each queued job has one message; a message runs its own
    job if it was interrupted, else the fairest queued job (its own job, if not run yet, is then
    picked by a later message). Returns a running TrainingJob or None."""
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().filter(pk=job_id).first()
        if job is not None and job.state == TrainingJob.State.RUNNING:
            return job  # redelivered after a crash (or a visibility timeout): rerun it
        candidate = next_queued_job()
        if candidate is None:
            return None
        candidate.state = TrainingJob.State.RUNNING
        candidate.started_at = timezone.now()
        candidate.save(update_fields=["state", "started_at"])
        return candidate


def _hold_job_lock(job_id):
    """A Postgres session advisory lock per job: held while a worker runs it and released when
    the worker's connection dies, so a redelivered message can tell a crashed run from a live one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [0x7261, job_id])
        return cursor.fetchone()[0]


def _release_job_lock(job_id):
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [0x7261, job_id])


def report(job, progress=None):
    if progress is not None:
        job.progress = progress
        TrainingJob.objects.filter(pk=job.pk).update(progress=progress)
    services.push_job_progress(job)


def finish_failed(job, reason, *, state=TrainingJob.State.FAILED):
    """The previous version stays active; staging files go; samples go back to ready."""
    shutil.rmtree(staging_dir(job.pk), ignore_errors=True)
    with transaction.atomic():
        TrainingSample.objects.filter(job=job, state=TrainingSample.State.IN_JOB).update(
            state=TrainingSample.State.READY, job=None)
        job.state = state
        job.error = reason[:2000]
        job.finished_at = timezone.now()
        job.save(update_fields=["state", "error", "finished_at"])
        services.audit(actor=None, action=f"job_{state}", subject_user_id=job.user_id, agent_id=job.agent_id,
                       target=job, reason=reason[:2000])
    report(job)


def _publish(job, metrics):
    """Publish the staged adapter once per job and activate it; a rerun finds result_version set."""
    from serving import services as serving_services

    from .config import TrainingConfig

    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if job.result_version_id is None:
            version = serving_services.publish_version(
                user_id=job.user_id, agent_id=job.agent_id, source_dir=staging_dir(job.pk),
                parent=job.parent_version, config=TrainingConfig.from_dict(job.config).to_dict(),
                metrics={**metrics, "job_id": job.pk})
            job.result_version = version
            job.metrics = metrics
            job.save(update_fields=["result_version", "metrics"])
    return job


def execute_job(job):
    """Train, guard, publish, activate; on any failure the job fails and nothing changes."""
    from serving import services as serving_services

    from .config import TrainingConfig
    from .trainer import Cancelled, GuardFailed, examples_from_samples, train

    if job.result_version_id is None:
        # A rerun starts over: whatever a crashed run left staged is stale.
        shutil.rmtree(staging_dir(job.pk), ignore_errors=True)
        with transaction.atomic():
            job.parent_version = serving_services.active_version_for(job.user_id, job.agent_id)
            job.save(update_fields=["parent_version"])
            if not job.samples.exists():
                if job.trigger == "offline":  # the offline baseline: every correction logged so far
                    batch = TrainingSample.objects.filter(user=job.user, agent=job.agent, target_text__gt="").exclude(
                        state=TrainingSample.State.DISCARDED)
                else:  # every usable sample: a batch that grew while the job was queued trains at once
                    batch = services.usable_samples(job.user, job.agent, job.method)
                batch.update(state=TrainingSample.State.IN_JOB, job=job)
        report(job, 0)
        samples = list(job.samples.select_related("turn__adapter_version"))
        config = TrainingConfig.from_dict(job.config)
        examples, skipped = examples_from_samples(samples)
        replayed, _ = examples_from_samples(services.corrections_to_replay(job, config.replay_corrections))
        agent = job.agent
        try:
            metrics = train(
                config, examples + replayed,
                base_model_path=settings.MODEL,
                init_adapter_dir=job.parent_version.path if job.parent_version else None,
                out_dir=staging_dir(job.pk),
                served_model_name=settings.SERVED_MODEL_NAME,
                probe_prompts=agent.probe_prompts or None,
                progress=lambda percent, parts: report(job, min(percent, 99)),
                should_stop=lambda: TrainingJob.objects.filter(pk=job.pk, cancel_requested=True).exists(),
                device=settings.TRAIN_DEVICE,
            )
        except Cancelled as exc:
            finish_failed(job, str(exc), state=TrainingJob.State.CANCELLED)
            return job
        except GuardFailed as exc:
            finish_failed(job, f"guard: {exc}")
            return job
        except Exception as exc:  # any crash inside the numeric loop fails the job, never the worker
            logger.exception("training job %s failed", job.pk)
            finish_failed(job, f"{type(exc).__name__}: {exc}")
            return job
        metrics["samples_skipped"] = sorted(set(metrics.get("samples_skipped", [])) | set(skipped))
        metrics["samples_replayed"] = len(replayed)
        if TrainingJob.objects.filter(pk=job.pk, cancel_requested=True).exists():
            finish_failed(job, "cancelled after the last step", state=TrainingJob.State.CANCELLED)
            return job
        job = _publish(job, metrics)
        shutil.rmtree(staging_dir(job.pk), ignore_errors=True)

    # Activate (hot-load + audit); a rerun after a crash here activates the same version again.
    version = job.result_version
    from serving.services import AdapterIntegrityError

    try:
        services.activate(version, user=job.user, agent=job.agent, actor=None, reason=f"training job {job.pk}")
    except AdapterIntegrityError as exc:
        finish_failed(job, f"published {version.name} but could not activate it: {exc}")
        return job
    with transaction.atomic():
        TrainingSample.objects.filter(job=job, state=TrainingSample.State.IN_JOB).update(state=TrainingSample.State.USED)
        job.state = TrainingJob.State.SUCCEEDED
        job.progress = 100
        job.finished_at = timezone.now()
        job.save(update_fields=["state", "progress", "finished_at"])
    report(job)
    # Feedback that arrived during the job may already fill the next batch.
    services.maybe_request_training(job.user, job.agent)
    return job


@shared_task(acks_late=True, reject_on_worker_lost=True)  # routed to `training` (settings)
def run_training_job(job_id):
    """Run one queued training job (the fairest one, see claim_job)."""
    job = claim_job(job_id)
    if job is None:
        return "nothing queued"
    if not _hold_job_lock(job.pk):
        return f"job {job.pk} is running on another worker"
    try:
        job = execute_job(job)
        return f"job {job.pk} {job.state}"
    finally:
        _release_job_lock(job.pk)


@shared_task
def enforce_adapter_retention():
    """Delete files of versions beyond the newest ADAPTER_KEEP_LAST per (user, agent), never the
    active or a pinned one; the rows stay (state deleted) so history and audit still read. Also
    removes staging directories a crashed writer left behind. Returns what it removed."""
    from serving.adapters import clean_staging, delete_adapter
    from serving.models import AdapterVersion

    keep = max(0, settings.ADAPTER_KEEP_LAST)
    removed = []
    # order_by(): Meta.ordering would add `number` to the DISTINCT and repeat each pair.
    pairs = (AdapterVersion.objects.filter(state=AdapterVersion.State.READY).order_by()
             .values_list("user_id", "agent_id").distinct())
    for user_id, agent_id in pairs:
        newest = list(AdapterVersion.objects.for_pair(user_id, agent_id).order_by("-number")
                      .values_list("pk", flat=True)[:keep])
        stale = (AdapterVersion.objects.for_pair(user_id, agent_id).exclude(pk__in=newest)
                 .filter(state=AdapterVersion.State.READY, is_active=False, pinned=False))
        for candidate in stale:
            with transaction.atomic():
                # Re-read under a row lock: it may have been activated or pinned since the query.
                version = AdapterVersion.objects.select_for_update().get(pk=candidate.pk)
                if version.is_active or version.pinned or version.state != AdapterVersion.State.READY:
                    continue
                version.state = AdapterVersion.State.DELETED
                version.save(update_fields=["state"])
                services.audit(actor=None, action="delete_adapter_files", subject_user_id=user_id, agent_id=agent_id,
                               target=version, reason=f"retention: older than the last {keep}")
            delete_adapter(version.name)
            removed.append(version.name)
    staging = clean_staging() + _clean_job_staging()
    if staging:
        services.audit(actor=None, action="clean_adapter_staging", reason="retention: stale staging directories",
                       after={"removed": staging})
    return {"deleted": removed, "staging": staging}


def _clean_job_staging(max_age_s=3600):
    """Remove `.staging/job-<id>` directories of jobs that are not running (older than `max_age_s`)."""
    import time

    root = staging_dir(0).parent
    if not root.is_dir():
        return []
    running = {f"job-{pk}" for pk in TrainingJob.objects.filter(state=TrainingJob.State.RUNNING).values_list("pk", flat=True)}
    removed = []
    for entry in root.iterdir():
        if entry.name.startswith("job-") and entry.name not in running and time.time() - entry.stat().st_mtime > max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(f".staging/{entry.name}")
    return removed


@worker_ready.connect(dispatch_uid="training.restore_replica_adapters")
def _restore_replica_adapters(sender=None, **kwargs):
    """A worker that starts re-loads every active adapter onto replicas that lack it (a replica
    restarted or joined while nothing ran). Best effort: a failure is logged, the worker starts."""
    from serving.services import ensure_replica_adapters

    try:
        loaded = ensure_replica_adapters()
    except Exception:
        logger.exception("could not restore active adapters on the inference replicas")
    else:
        logger.info("restored active adapters on the replicas: %s", loaded)
    finally:
        connection.close()  # the main process keeps no connection for the pool's children to inherit


@celeryd_after_setup.connect(dispatch_uid="training.warm_imports")
def _warm_training_imports(sender, instance, **kwargs):
    """A training worker imports torch/transformers/peft once at start (tens of seconds on a
    busy CPU), not inside the first job, where it would count against feedback-to-live."""
    queues = getattr(instance.app.amqp.queues, "consume_from", None) or {}
    if "training" in queues:
        import peft  # noqa: F401
        import transformers  # noqa: F401
