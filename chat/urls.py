"""Pages under the `chat` namespace, plus the account routes Django's auth settings name.

`LOGIN_URL = "login"` names a route outside any namespace, so the account routes sit beside
the namespaced pages instead of inside them.
"""
from importlib.util import find_spec

from django.contrib.auth import views as auth_views
from django.urls import include, path

from . import views

# No module-level `app_name`: it would namespace the account routes too.
PAGES_NAMESPACE = "chat"

page_patterns = [
    path("", views.home, name="home"),
    path("agents/new/", views.agent_create, name="agent_create"),
    path("agents/<int:agent_id>/", views.agent_chat, name="agent_chat"),
    path("agents/<int:agent_id>/edit/", views.agent_edit, name="agent_edit"),
    path("agents/<int:agent_id>/delete/", views.agent_delete, name="agent_delete"),
    path("c/<int:conversation_id>/", views.conversation_detail, name="conversation"),
    path("c/<int:conversation_id>/rename/", views.conversation_rename, name="conversation_rename"),
    path("c/<int:conversation_id>/delete/", views.conversation_delete, name="conversation_delete"),
    path("settings/", views.settings_view, name="settings"),
    path("settings/keys/", views.api_key_create, name="api_key_create"),
    path("settings/keys/<int:key_id>/revoke/", views.api_key_revoke, name="api_key_revoke"),
    path("settings/password/", views.PasswordChangeView.as_view(), name="password_change"),
    path("settings/account/", include("chat.account_urls")),
    path("invite/", views.invite, name="invite"),
]
# The JSON API and /v1 (chat/api_urls.py) are built alongside; mount them once they exist.
if find_spec("chat.api_urls") is not None:
    page_patterns.append(path("", include("chat.api_urls")))

account_patterns = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("signup/", views.signup, name="signup"),
    path("reset/<uidb64>/<token>/", auth_views.PasswordResetConfirmView.as_view(), name="password_reset_confirm"),
    path("reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
]

urlpatterns = [
    path("", include((page_patterns, PAGES_NAMESPACE))),
    *account_patterns,
]
