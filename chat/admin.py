from django.contrib import admin

from .models import Agent, ApiKey, Conversation, Feedback, Turn


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "owner", "training_method", "review_policy", "training_enabled")
    list_filter = ("training_method", "review_policy", "training_enabled")
    search_fields = ("name", "slug", "owner__username")
    prepopulated_fields = {"slug": ("name",)}
    raw_id_fields = ("owner",)


class TurnInline(admin.TabularInline):
    model = Turn
    fields = ("index", "role", "status", "turn_type", "content", "adapter_name")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ("__str__", "user", "agent", "source", "done", "updated_at")
    list_filter = ("source", "done")
    search_fields = ("title", "user__username", "session_key")
    # list_display shows user and agent: fetch them in the same query.
    list_select_related = ("user", "agent")
    raw_id_fields = ("user", "agent")
    inlines = [TurnInline]


@admin.register(Turn)
class TurnAdmin(admin.ModelAdmin):
    list_display = ("__str__", "role", "status", "turn_type", "adapter_name", "created_at")
    list_filter = ("role", "status", "turn_type")
    search_fields = ("content",)
    raw_id_fields = ("conversation", "parent", "adapter_version")
    readonly_fields = ("prompt_token_ids", "token_ids", "logprobs", "sampling_params")


@admin.register(Feedback)
class FeedbackAdmin(admin.ModelAdmin):
    list_display = ("__str__", "author", "kind", "status", "withdrawn", "created_at")
    list_filter = ("kind", "status", "withdrawn")
    search_fields = ("comment", "corrected_text", "author__username")
    list_select_related = ("author",)
    raw_id_fields = ("turn", "next_turn", "author", "reviewer", "reserved_by")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "user", "created_at", "last_used_at", "revoked_at")
    search_fields = ("name", "prefix", "user__username")
    # The hash is useless to a person and must not be edited.
    exclude = ("key_hash",)
    readonly_fields = ("prefix", "created_at", "last_used_at")
    raw_id_fields = ("user",)
