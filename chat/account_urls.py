"""The user's own account: data export and deletion (mounted under /settings/account/, namespace `chat`)."""
from django.urls import path

from . import account

urlpatterns = [
    path("export/", account.export_page, name="export"),
    path("export/conversations.json", account.export_conversations_view, name="export_conversations"),
    path("export/adapters.zip", account.export_adapters_view, name="export_adapters"),
    path("delete/", account.delete_page, name="account_delete"),
]
