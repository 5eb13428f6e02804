"""Learning from what was said: samples, jobs, pauses and the audit log."""
from django.conf import settings
from django.db import models
from django.db.models import Q


class TrainingSample(models.Model):
    """One unit of learning signal derived from a piece of feedback.

    Evaluative samples carry a reward for the turn's reply (Binary RL); directive samples carry
    a target a* and the hint-enhanced context c' (hindsight OPD). A correction is both.
    """

    class State(models.TextChoices):
        READY = "ready", "Ready"
        IN_JOB = "in_job", "In a job"
        USED = "used", "Used"
        DISCARDED = "discarded", "Discarded"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="training_samples")
    agent = models.ForeignKey("chat.Agent", on_delete=models.CASCADE, related_name="training_samples")
    feedback = models.ForeignKey("chat.Feedback", on_delete=models.CASCADE, related_name="samples")
    turn = models.ForeignKey("chat.Turn", on_delete=models.CASCADE, related_name="training_samples")
    reward = models.FloatField(null=True, blank=True, help_text="+1 / -1 for evaluative samples.")
    target_text = models.TextField(blank=True, help_text="a*: the corrected reply, for directive samples.")
    hint = models.TextField(blank=True)
    context_messages = models.JSONField(default=list, help_text="c: the messages the reply answered.")
    enhanced_messages = models.JSONField(default=list, blank=True, help_text="c': c with the hindsight hint.")
    classifier = models.CharField(max_length=32, help_text="explicit, rules or llm_judge.")
    provenance = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY, db_index=True)
    job = models.ForeignKey("TrainingJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="samples")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self):
        return f"sample {self.pk} ({self.state})"

    @property
    def is_evaluative(self):
        return self.reward is not None

    @property
    def is_directive(self):
        return bool(self.target_text)


class TrainingJob(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    OPEN_STATES = (State.QUEUED, State.RUNNING)

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="training_jobs")
    agent = models.ForeignKey("chat.Agent", on_delete=models.CASCADE, related_name="training_jobs")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED, db_index=True)
    method = models.CharField(max_length=16)
    trigger = models.CharField(max_length=32, default="auto", help_text="auto, manual, admin or offline.")
    progress = models.PositiveSmallIntegerField(default=0)
    config = models.JSONField(default=dict, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    task_id = models.CharField(max_length=64, blank=True)
    cancel_requested = models.BooleanField(default=False)
    parent_version = models.ForeignKey(
        "serving.AdapterVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    result_version = models.OneToOneField(
        "serving.AdapterVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="job"
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "agent"], condition=Q(state__in=["queued", "running"]), name="one_open_job_per_user_agent"
            )
        ]

    def __str__(self):
        return f"job {self.pk} ({self.state})"

    @property
    def duration_s(self):
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None


class TrainingPause(models.Model):
    """Staff pause training for a user, an agent, or one user on one agent."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    agent = models.ForeignKey("chat.Agent", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    reason = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(user__isnull=False) | Q(agent__isnull=False), name="pause_names_a_target")
        ]

    def __str__(self):
        return f"pause user={self.user_id} agent={self.agent_id}"


class AuditEventQuerySet(models.QuerySet):
    def update(self, **kwargs):
        # Only tombstoning (account deletion) may rewrite an event.
        if set(kwargs) - {"actor", "actor_id", "actor_label", "subject_user_id", "subject_label"}:
            raise PermissionError("The audit log is append-only.")
        return super().update(**kwargs)

    def delete(self):
        raise PermissionError("The audit log is append-only.")


class AuditEvent(models.Model):
    """Append-only record of who did what, when, why, and what it was before."""

    TOMBSTONE = "deleted-user"

    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor_label = models.CharField(max_length=150, help_text="Username, 'system', or the tombstone.")
    action = models.CharField(max_length=64, db_index=True)
    subject_user_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    subject_label = models.CharField(max_length=150, blank=True)
    agent_id = models.BigIntegerField(null=True, blank=True)
    target_type = models.CharField(max_length=64, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    reason = models.TextField(blank=True)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.actor_label} {self.action}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise PermissionError("The audit log is append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("The audit log is append-only.")


class Judgement(models.Model):
    """What the classifier (rules or LLM judge) read in a comment or next-state message.

    Kept apart from the samples because samples are only built on approval, and a reviewer
    should see the verdict (and the judge's votes) before approving.
    """

    feedback = models.OneToOneField("chat.Feedback", on_delete=models.CASCADE, related_name="judgement")
    classifier = models.CharField(max_length=32, help_text="rules or llm_judge.")
    score = models.SmallIntegerField(default=0, help_text="+1, -1 or 0 (ambiguous).")
    hint = models.TextField(blank=True)
    details = models.JSONField(default=dict, blank=True, help_text="Matched patterns, or the judge's votes.")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return f"{self.classifier} {self.score:+d} on feedback {self.feedback_id}"
