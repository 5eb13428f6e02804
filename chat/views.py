"""Browser pages: agents, the chat page, settings (API keys, password) and accounts.

Streaming goes over the WebSocket (`consumers.py`) and feedback over the JSON API (`api.py`);
these views render what is saved, so that a reload shows a conversation exactly as stored.
"""
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.tokens import default_token_generator
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse, reverse_lazy
from django.utils import timezone
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode
from django.views.decorators.http import require_POST

from . import services
from .forms import AgentForm, ApiKeyForm, ConversationRenameForm, InviteForm, SignupForm
from .models import Agent, ApiKey, Conversation, Feedback, Turn

THUMB_REASONS = {
    "thumb_down": ["Not factually correct", "Didn't follow instructions", "Too long", "Wrong style", "Other"],
    "thumb_up": ["Accurate", "Followed instructions", "Good style", "Concise", "Other"],
}
RAW_KEY_SESSION = "chat:new_api_key"


# ---------------------------------------------------------------------------
# Agents
# ---------------------------------------------------------------------------

@login_required
def home(request):
    agents = Agent.objects.visible_to(request.user)
    recent = Conversation.objects.filter(user=request.user).select_related("agent")[:8]
    return render(request, "chat/home.html", {"agents": agents, "recent": recent})


@login_required
def agent_create(request):
    form = AgentForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        agent = form.save()
        messages.success(request, f"Agent “{agent.name}” created.")
        return redirect("chat:agent_chat", agent_id=agent.pk)
    return render(request, "chat/agent_form.html", {"form": form})


@login_required
def agent_edit(request, agent_id):
    agent = get_object_or_404(Agent, pk=agent_id, owner=request.user)
    form = AgentForm(request.POST or None, instance=agent, user=request.user)
    if request.method == "POST" and form.is_valid():
        form.save()
        messages.success(request, "Agent saved.")
        return redirect("chat:home")
    return render(request, "chat/agent_form.html", {"form": form, "agent": agent})


@login_required
def agent_delete(request, agent_id):
    agent = get_object_or_404(Agent, pk=agent_id, owner=request.user)
    if request.method == "POST":
        name = agent.name
        agent.delete()
        messages.success(request, f"Agent “{name}” deleted.")
        return redirect("chat:home")
    return render(request, "chat/agent_confirm_delete.html", {"agent": agent})


# ---------------------------------------------------------------------------
# Conversations and the chat page
# ---------------------------------------------------------------------------

@login_required
def agent_chat(request, agent_id):
    """A new, empty conversation with an agent; the first message creates it over the socket."""
    agent = get_object_or_404(Agent.objects.visible_to(request.user), pk=agent_id)
    return _render_chat(request, agent, None)


@login_required
def conversation_detail(request, conversation_id):
    conversation = get_object_or_404(
        Conversation.objects.select_related("agent"), pk=conversation_id, user=request.user
    )
    return _render_chat(request, conversation.agent, conversation)


@login_required
@require_POST
def conversation_rename(request, conversation_id):
    conversation = get_object_or_404(Conversation, pk=conversation_id, user=request.user)
    form = ConversationRenameForm(request.POST, instance=conversation)
    if form.is_valid():
        services.rename_conversation(conversation, form.cleaned_data["title"], user=request.user)
    else:
        messages.error(request, " ".join(form.errors.get("title", ["Invalid title."])))
    return redirect("chat:conversation", conversation_id=conversation.pk)


@login_required
@require_POST
def conversation_delete(request, conversation_id):
    conversation = get_object_or_404(Conversation, pk=conversation_id, user=request.user)
    agent_id = conversation.agent_id
    services.delete_conversation(conversation, user=request.user)
    messages.success(request, "Conversation deleted.")
    return redirect("chat:agent_chat", agent_id=agent_id)


def _render_chat(request, agent, conversation):
    query = request.GET.get("q", "").strip()
    turns = list(conversation.turns.all()) if conversation else []
    branch = services.shown_branch(conversation) if conversation else []
    feedback = _feedback_by_turn(turns, request.user)
    rows = []
    cut_before = _cut_before(branch)
    for turn in branch:
        if turn.role == Turn.Role.SYSTEM:
            continue
        payload = services.turn_payload(turn)
        rows.append({
            "turn": turn,
            "feedback": feedback.get(turn.pk, {}),
            "version": payload["version"],
            "siblings": payload.get("siblings") or {"count": 1, "position": 1},
            "cut_before": turn.pk == cut_before,
        })
    data = {
        "agent_id": agent.pk,
        "agent_name": agent.name,
        "conversation_id": conversation.pk if conversation else None,
        "conversation_title": conversation.title if conversation else "",
        "conversation_url_template": reverse("chat:conversation", kwargs={"conversation_id": 0}),
        "ws_path": "/ws/chat/",
        "feedback_url_template": "/api/turns/0/feedback",
        "panel_url": f"/training/agents/{agent.pk}/panel/",
        "max_message_chars": settings.MAX_MESSAGE_CHARS,
        "max_correction_chars": settings.MAX_CORRECTION_CHARS,
        "reasons": THUMB_REASONS,
        "turns": [{**services.turn_payload(t), "feedback": feedback.get(t.pk, {})} for t in turns],
    }
    return render(request, "chat/chat.html", {
        "agent": agent,
        "conversation": conversation,
        "rows": rows,
        "groups": _sidebar_groups(request.user, agent, query),
        "query": query,
        "chat_data": data,
        "can_edit_agent": agent.owner_id == request.user.pk,
    })


def _cut_before(branch):
    """The id of the first turn the model still saw, when the last reply's context was cut."""
    replies = [t for t in branch if t.role == Turn.Role.ASSISTANT and t.context_start_index is not None]
    if not replies:
        return None
    start = replies[-1].context_start_index
    visible = [t for t in branch if t.role != Turn.Role.SYSTEM]
    if not visible or visible[0].index >= start:
        return None
    for turn in visible:
        if turn.index >= start:
            return turn.pk
    return None


def _feedback_by_turn(turns, user):
    """The user's live thumb and latest correction on each turn."""
    state = {}
    rows = Feedback.objects.filter(
        turn__in=[t.pk for t in turns], author=user, withdrawn=False,
        kind__in=[Feedback.Kind.THUMB_UP, Feedback.Kind.THUMB_DOWN, Feedback.Kind.CORRECTION],
    ).order_by("created_at", "pk")
    for fb in rows:
        entry = state.setdefault(fb.turn_id, {})
        if fb.kind == Feedback.Kind.CORRECTION:
            entry["correction"] = {"id": fb.pk, "corrected_text": fb.corrected_text, "status": fb.status}
        else:
            entry["thumb"] = {"id": fb.pk, "kind": fb.kind, "reason": fb.reason, "comment": fb.comment}
    return state


def _sidebar_groups(user, agent, query):
    """The user's conversations with an agent, newest first, grouped like Open WebUI."""
    today = timezone.localdate()
    labels = [
        ("Today", today),
        ("Yesterday", today - timedelta(days=1)),
        ("Previous 7 days", today - timedelta(days=7)),
        ("Older", None),
    ]
    groups = {label: [] for label, _ in labels}
    for conversation in services.search_conversations(user, agent, query)[:200]:
        day = timezone.localdate(conversation.updated_at)
        for label, since in labels:
            if since is None or day >= since:
                groups[label].append(conversation)
                break
    return [(label, items) for label, items in groups.items() if items]


# ---------------------------------------------------------------------------
# Settings: API keys and password
# ---------------------------------------------------------------------------

@login_required
def settings_view(request):
    return render(request, "chat/settings.html", {
        "keys": ApiKey.objects.filter(user=request.user),
        "key_form": ApiKeyForm(),
        "new_key": request.session.pop(RAW_KEY_SESSION, None),
    })


@login_required
@require_POST
def api_key_create(request):
    form = ApiKeyForm(request.POST)
    if not form.is_valid():
        return render(request, "chat/settings.html", {
            "keys": ApiKey.objects.filter(user=request.user), "key_form": form, "new_key": None,
        }, status=400)
    key, raw = ApiKey.objects.create_key(request.user, form.cleaned_data["name"])
    # Shown once, on the next page; only the hash is kept.
    request.session[RAW_KEY_SESSION] = {"name": key.name, "raw": raw}
    return redirect("chat:settings")


@login_required
@require_POST
def api_key_revoke(request, key_id):
    key = get_object_or_404(ApiKey, pk=key_id, user=request.user)
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        messages.success(request, f"Key “{key.name}” revoked.")
    return redirect("chat:settings")


class PasswordChangeView(auth_views.PasswordChangeView):
    template_name = "registration/password_change_form.html"
    success_url = reverse_lazy("chat:settings")

    def form_valid(self, form):
        response = super().form_valid(form)
        messages.success(self.request, "Password changed.")
        return response


# ---------------------------------------------------------------------------
# Accounts: signup (when open) and staff invitations
# ---------------------------------------------------------------------------

def signup(request):
    if request.user.is_authenticated:
        return redirect("chat:home")
    if not settings.SIGNUP_OPEN:
        return render(request, "registration/signup_closed.html", status=403)
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = form.save()
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        messages.success(request, "Welcome! Create an agent or pick one to start chatting.")
        return redirect("chat:home")
    return render(request, "registration/signup.html", {"form": form})


@staff_member_required
def invite(request):
    form = InviteForm(request.POST or None)
    link = None
    if request.method == "POST" and form.is_valid():
        invited = form.save()
        path = reverse("password_reset_confirm", kwargs={
            "uidb64": urlsafe_base64_encode(force_bytes(invited.pk)),
            "token": default_token_generator.make_token(invited),
        })
        link = request.build_absolute_uri(path)
        messages.success(request, f"Invited {invited.username}. Send them the link below to set a password.")
        form = InviteForm()
    return render(request, "registration/invite.html", {"form": form, "link": link})
