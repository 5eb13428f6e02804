from django.contrib import admin

from serving.models import AdapterVersion


@admin.register(AdapterVersion)
class AdapterVersionAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "agent_id", "number", "is_active", "state", "pinned", "base_model_name",
                    "size_bytes", "activated_at", "activated_by", "created_at")
    list_filter = ("is_active", "state", "pinned", "base_model_name")
    search_fields = ("name", "user__username", "sha256")
    # Activation goes through serving.services (it hot-loads on every replica), never a checkbox here.
    readonly_fields = ("user", "agent_id", "number", "name", "parent", "path", "sha256", "size_bytes",
                       "base_model_name", "base_model_hash", "config", "metrics", "state", "is_active",
                       "activated_at", "activated_by", "created_at")
    list_select_related = ("user",)
    ordering = ("-created_at",)
    date_hierarchy = "created_at"
