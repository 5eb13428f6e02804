"""Talking to agents: agents, conversations, turns, feedback on turns, and API keys."""
import hashlib
import secrets

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone


class AgentQuerySet(models.QuerySet):
    def visible_to(self, user):
        """Global agents (made by staff) and the user's own."""
        return self.filter(Q(owner__isnull=True) | Q(owner=user))


class Agent(models.Model):
    class Method(models.TextChoices):
        BINARY = "binary", "Binary RL"
        OPD = "opd", "Hindsight OPD"
        COMBINED = "combined", "Combined (Binary RL + OPD)"
        OFFLINE = "offline", "Offline SFT on corrections"

    class ReviewPolicy(models.TextChoices):
        AUTO_ALL = "auto_all", "Auto-approve everything"
        AUTO_THUMBS = "auto_thumbs", "Auto-approve thumbs, hold corrections and comments"
        HOLD_ALL = "hold_all", "Hold everything for review"

    class Classifier(models.TextChoices):
        RULES = "rules", "Rules (English and Korean patterns)"
        LLM_JUDGE = "llm_judge", "LLM judge (OpenClaw-RL prompts)"

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="agents",
        help_text="Empty for a global agent made by staff.",
    )
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100)
    description = models.CharField(max_length=300, blank=True)
    system_prompt = models.TextField(blank=True)
    base_model = models.CharField(max_length=300, blank=True, help_text="Empty: the served MODEL.")
    # Generation defaults
    temperature = models.FloatField(default=0.7)
    top_p = models.FloatField(default=1.0)
    max_tokens = models.PositiveIntegerField(default=256)
    # Training settings
    training_enabled = models.BooleanField(default=True)
    training_method = models.CharField(max_length=16, choices=Method.choices, default=Method.COMBINED)
    alpha = models.FloatField(default=0.5, help_text="Weight of the OPD loss in the combined loss.")
    learning_rate = models.FloatField(default=1e-3)
    lora_rank = models.PositiveSmallIntegerField(default=8)
    batch_size = models.PositiveSmallIntegerField(default=4, help_text="Corrected replies, or replies with a reward alone, that trigger a job.")
    steps_per_job = models.PositiveSmallIntegerField(default=16)
    kl_coef = models.FloatField(
        default=0.1, help_text="Weight of the KL penalty on the replies PPO trains on: what the user did not correct "
        "stays near the base model, and a thumbed-up reply's style near the version the job starts from. 0 turns it off.")
    kl_base_min_prob = models.FloatField(
        default=0.1, validators=[MinValueValidator(0.0), MaxValueValidator(0.99)],
        help_text="On thumbed-up replies, the KL holds the tokens the base model finds at least this likely to the "
        "base model (a thumb on the style does not vouch for the content), the rest to the current version. "
        "0: every token to the current version.")
    distill_kept_tokens = models.BooleanField(
        default=True, help_text="OPD holds the tokens a correction kept to the base model instead of learning "
        "them again: better retention of other skills, slower learning of the preference.")
    distill_min_base_prob = models.FloatField(
        default=0.1, validators=[MinValueValidator(0.0), MaxValueValidator(0.99)],
        help_text="With distill_kept_tokens, only the kept tokens the base model itself finds at least this "
        "likely are held to it; the rest (the style the adapter has begun to write) are learned. 0: every kept token.")
    review_policy = models.CharField(max_length=16, choices=ReviewPolicy.choices, default=ReviewPolicy.AUTO_THUMBS)
    classifier = models.CharField(max_length=16, choices=Classifier.choices, default=Classifier.RULES)
    probe_prompts = models.JSONField(default=list, blank=True, help_text="Fixed prompts for behaviour diffs and the KL guard.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = AgentQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "slug"], name="unique_agent_slug_per_owner"),
            models.UniqueConstraint(fields=["slug"], condition=Q(owner__isnull=True), name="unique_global_agent_slug"),
        ]

    def __str__(self):
        return self.name

    @property
    def is_global(self):
        return self.owner_id is None


class Conversation(models.Model):
    class Source(models.TextChoices):
        WEB = "web", "Browser"
        API = "api", "API"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="conversations")
    title = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=8, choices=Source.choices, default=Source.WEB)
    session_key = models.CharField(max_length=200, blank=True, help_text="X-Session-Id of /v1 clients.")
    done = models.BooleanField(default=False, help_text="X-Session-Done was received.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        ordering = ["-updated_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "agent", "session_key"], condition=~Q(session_key=""), name="unique_api_session_per_user_agent"
            )
        ]

    def __str__(self):
        return self.title or f"Conversation {self.pk}"


class Turn(models.Model):
    class Role(models.TextChoices):
        SYSTEM = "system", "System"
        USER = "user", "User"
        ASSISTANT = "assistant", "Assistant"
        TOOL = "tool", "Tool"

    class Status(models.TextChoices):
        STREAMING = "streaming", "Streaming"
        COMPLETE = "complete", "Complete"
        FAILED = "failed", "Failed"
        STOPPED = "stopped", "Stopped"

    class TurnType(models.TextChoices):
        MAIN = "main", "Main"
        SIDE = "side", "Side"

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="turns")
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children",
        help_text="The turn this one answers; regenerated replies are siblings under one parent.",
    )
    index = models.PositiveIntegerField(help_text="Depth in the conversation; siblings share it.")
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.COMPLETE)
    turn_type = models.CharField(max_length=8, choices=TurnType.choices, default=TurnType.MAIN)
    error = models.TextField(blank=True)
    # Assistant turns: what produced them, exactly, for PPO's old policy.
    adapter_version = models.ForeignKey(
        "serving.AdapterVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="turns"
    )
    adapter_name = models.CharField(max_length=100, blank=True, help_text="Empty for the base model.")
    prompt_token_ids = models.JSONField(null=True, blank=True)
    token_ids = models.JSONField(null=True, blank=True)
    logprobs = models.JSONField(null=True, blank=True)
    sampling_params = models.JSONField(default=dict, blank=True)
    context_start_index = models.PositiveIntegerField(
        null=True, blank=True, help_text="First turn index that fit in the model's context; earlier ones were cut."
    )
    latency_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["conversation_id", "index", "created_at", "id"]
        indexes = [models.Index(fields=["conversation", "index"])]

    def __str__(self):
        return f"{self.role} #{self.index} of {self.conversation_id}"

    @property
    def version_label(self):
        return self.adapter_version.label if self.adapter_version_id else "base"


class Feedback(models.Model):
    class Kind(models.TextChoices):
        THUMB_UP = "thumb_up", "Thumb up"
        THUMB_DOWN = "thumb_down", "Thumb down"
        CORRECTION = "correction", "Correction"
        COMMENT = "comment", "Comment"
        IMPLICIT = "implicit", "Next-state message"

    class Status(models.TextChoices):
        PENDING = "pending", "Pending review"
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"

    THUMBS = (Kind.THUMB_UP, Kind.THUMB_DOWN)

    turn = models.ForeignKey(Turn, on_delete=models.CASCADE, related_name="feedback")
    author = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="feedback")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    reason = models.CharField(max_length=100, blank=True)
    comment = models.TextField(blank=True)
    corrected_text = models.TextField(blank=True)
    next_turn = models.ForeignKey(
        Turn, null=True, blank=True, on_delete=models.CASCADE, related_name="+",
        help_text="For implicit feedback: the user message that followed the reply.",
    )
    reward_override = models.FloatField(null=True, blank=True, help_text="Set by a reviewer's fix & approve.")
    verdict = models.CharField(max_length=32, blank=True, help_text="The classifier's verdict: +1, -1, 0, hint.")
    withdrawn = models.BooleanField(default=False)
    # Review
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING, db_index=True)
    hold_reason = models.CharField(max_length=200, blank=True)
    reviewer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="reviewed_feedback"
    )
    review_note = models.TextField(blank=True)
    reviewed_at = models.DateTimeField(null=True, blank=True)
    reserved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="reserved_feedback"
    )
    reserved_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["turn", "author"],
                condition=Q(kind__in=["thumb_up", "thumb_down"], withdrawn=False),
                name="one_live_thumb_per_turn_author",
            )
        ]

    def __str__(self):
        return f"{self.kind} on turn {self.turn_id}"


class ApiKeyQuerySet(models.QuerySet):
    def live(self):
        return self.filter(revoked_at__isnull=True)


class ApiKeyManager(models.Manager.from_queryset(ApiKeyQuerySet)):
    def create_key(self, user, name):
        """Create a key; returns (ApiKey, raw_key). The raw key is shown once and never stored."""
        raw = "claw-" + secrets.token_urlsafe(32)
        key = self.create(user=user, name=name, prefix=raw[:12], key_hash=ApiKey.hash(raw))
        return key, raw


class ApiKey(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=12, help_text="The first characters, to tell keys apart.")
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiKeyManager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"

    @staticmethod
    def hash(raw):
        return hashlib.sha256(raw.encode()).hexdigest()
