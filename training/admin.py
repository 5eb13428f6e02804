from django.contrib import admin

from .models import AuditEvent, TrainingJob, TrainingPause, TrainingSample


@admin.register(TrainingSample)
class TrainingSampleAdmin(admin.ModelAdmin):
    list_display = ("id", "user", "agent", "state", "reward", "classifier", "created_at")
    list_filter = ("state", "classifier", "agent")
    search_fields = ("user__username", "target_text", "hint")
    raw_id_fields = ("user", "agent", "feedback", "turn", "job")
    date_hierarchy = "created_at"


@admin.register(TrainingJob)
class TrainingJobAdmin(admin.ModelAdmin):
    list_display = ("id", "user", "agent", "state", "method", "trigger", "progress", "created_at", "finished_at")
    list_filter = ("state", "method", "trigger", "agent")
    search_fields = ("user__username", "task_id", "error")
    raw_id_fields = ("user", "agent", "parent_version", "result_version")
    date_hierarchy = "created_at"


@admin.register(TrainingPause)
class TrainingPauseAdmin(admin.ModelAdmin):
    list_display = ("id", "user", "agent", "reason", "created_by", "created_at")
    raw_id_fields = ("user", "agent", "created_by")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read-only: the log is append-only, and only services write it."""

    list_display = ("created_at", "actor_label", "action", "subject_label", "agent_id", "target_type", "target_id")
    list_filter = ("action",)
    search_fields = ("actor_label", "subject_label", "reason", "target_id")
    date_hierarchy = "created_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
