"""The adapter registry: every LoRA version of every (user, agent), and which one is active.

Serving refers to agents by id only: it imports neither `chat` nor `training`.
"""
from django.conf import settings
from django.db import models
from django.db.models import Q


def adapter_name(user_id, agent_id, number):
    """The one name a version has on disk, in vLLM (`lora_name`) and in its filesystem resolver."""
    return f"u{user_id}-a{agent_id}-v{number}"


class AdapterVersionQuerySet(models.QuerySet):
    def for_pair(self, user_id, agent_id):
        return self.filter(user_id=user_id, agent_id=agent_id)

    def active(self):
        return self.filter(is_active=True)


class AdapterVersion(models.Model):
    class State(models.TextChoices):
        READY = "ready", "Ready"
        DELETED = "deleted", "Files deleted"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="adapter_versions")
    agent_id = models.BigIntegerField(db_index=True)
    number = models.PositiveIntegerField()
    name = models.CharField(max_length=100, unique=True)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children")
    path = models.CharField(max_length=500)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.BigIntegerField(default=0)
    base_model_name = models.CharField(max_length=300)
    base_model_hash = models.CharField(max_length=64)
    config = models.JSONField(default=dict, blank=True, help_text="Training config the version was made with.")
    metrics = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.READY)
    is_active = models.BooleanField(default=False)
    pinned = models.BooleanField(default=False, help_text="Pinned versions are never deleted by retention.")
    activated_at = models.DateTimeField(null=True, blank=True)
    activated_by = models.CharField(max_length=150, blank=True, help_text="Who or what activated it last.")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = AdapterVersionQuerySet.as_manager()

    class Meta:
        ordering = ["user_id", "agent_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["user", "agent_id", "number"], name="unique_version_number_per_user_agent"),
            models.UniqueConstraint(
                fields=["user", "agent_id"], condition=Q(is_active=True), name="one_active_version_per_user_agent"
            ),
        ]

    def __str__(self):
        return self.name

    @property
    def label(self):
        return f"v{self.number}"

    def is_compatible_with(self, base_model_name, base_model_hash):
        return self.base_model_hash == base_model_hash
