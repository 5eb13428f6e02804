"""A user's own account: download their data, delete the account.

Export: conversations (every turn, with the user's feedback on it) as JSON, and adapters as a zip
of PEFT directories named by version (`u<user>-a<agent>-v<n>/adapter_config.json` and
`adapter_model.safetensors`), exactly the files vLLM and `PeftModel.from_pretrained` load.

Deletion: chat owns the user row, so chat deletes it; apps that keep data about users without
chat knowing them (training: the audit log's tombstones; serving's adapter files) clean up on the
`account_deleting` signal, sent inside the same transaction. Chat never imports training.
Every view acts on `request.user` only: no URL names another user.
"""
import json
import tempfile
import zipfile

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model, logout
from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.dispatch import Signal
from django.http import FileResponse, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET

from .models import Agent, Conversation, Feedback, Turn

EXPORT_FORMAT = "claw-export/1"

# Sent as account_deleting.send(sender=User, user=user, actor=actor) inside the deleting
# transaction, before any row goes. Receivers may raise to abort the deletion.
account_deleting = Signal()


# Services
# ------------------------------------------------------------------------------


def _iso(value):
    return value.isoformat() if value else None


def _feedback_payload(fb):
    return {
        "id": fb.pk, "kind": fb.kind, "reason": fb.reason, "comment": fb.comment,
        "corrected_text": fb.corrected_text, "status": fb.status, "withdrawn": fb.withdrawn,
        "created_at": _iso(fb.created_at),
    }


def _turn_payload(turn, feedback):
    return {
        "id": turn.pk, "parent_id": turn.parent_id, "index": turn.index, "role": turn.role,
        "content": turn.content, "status": turn.status, "turn_type": turn.turn_type,
        "adapter": turn.adapter_name or None, "created_at": _iso(turn.created_at),
        "finished_at": _iso(turn.finished_at), "feedback": feedback.get(turn.pk, []),
    }


def export_conversations(user):
    """Everything the user said and was told, with their feedback, as a JSON-able dict."""
    feedback = {}
    for fb in Feedback.objects.filter(author=user).order_by("created_at", "pk"):
        feedback.setdefault(fb.turn_id, []).append(_feedback_payload(fb))
    turns = {}
    for turn in Turn.objects.filter(conversation__user=user).order_by("conversation_id", "index", "created_at", "pk"):
        turns.setdefault(turn.conversation_id, []).append(_turn_payload(turn, feedback))
    conversations = [
        {
            "id": c.pk, "agent": {"id": c.agent_id, "name": c.agent.name, "slug": c.agent.slug},
            "title": c.title, "source": c.source, "created_at": _iso(c.created_at), "updated_at": _iso(c.updated_at),
            "turns": turns.get(c.pk, []),
        }
        for c in Conversation.objects.filter(user=user).select_related("agent").order_by("created_at", "pk")
    ]
    agents = [
        {"id": a.pk, "name": a.name, "slug": a.slug, "description": a.description, "system_prompt": a.system_prompt}
        for a in Agent.objects.filter(owner=user).order_by("pk")
    ]
    return {
        "format": EXPORT_FORMAT,
        "exported_at": _iso(timezone.now()),
        "user": {"id": user.pk, "username": user.get_username(), "email": user.email,
                 "date_joined": _iso(user.date_joined)},
        "agents": agents,
        "conversations": conversations,
    }


def write_adapters_zip(user, out):
    """Write the user's stored adapter versions to `out` (a binary file) as a zip of PEFT directories.

    Only versions whose files are on disk and still match their recorded sha256 are included;
    `manifest.json` at the root lists every version and says why one was left out.

    Returns:
        The names of the versions included.
    """
    from serving.adapters import ADAPTER_FILES, AdapterIntegrityError, verify
    from serving.models import AdapterVersion

    included, manifest = [], []
    with zipfile.ZipFile(out, "w") as archive:
        for version in AdapterVersion.objects.filter(user=user).order_by("agent_id", "number"):
            entry = {
                "name": version.name, "agent_id": version.agent_id, "number": version.number,
                "active": version.is_active, "pinned": version.pinned, "sha256": version.sha256,
                "base_model_name": version.base_model_name, "base_model_hash": version.base_model_hash,
                "parent": version.parent.name if version.parent_id else None,
                "created_at": _iso(version.created_at), "metrics": version.metrics, "included": False,
            }
            manifest.append(entry)
            if version.state != AdapterVersion.State.READY:
                entry["note"] = "files deleted by retention"
                continue
            try:
                verify(version.path, version.sha256)
            except AdapterIntegrityError as exc:
                entry["note"] = str(exc)
                continue
            for filename in ADAPTER_FILES:
                # safetensors barely compress; store them and spare the CPU.
                kind = zipfile.ZIP_DEFLATED if filename.endswith(".json") else zipfile.ZIP_STORED
                archive.write(f"{version.path}/{filename}", f"{version.name}/{filename}", compress_type=kind)
            entry["included"] = True
            included.append(version.name)
        archive.writestr("manifest.json", json.dumps({"format": EXPORT_FORMAT, "versions": manifest}, indent=2),
                         compress_type=zipfile.ZIP_DEFLATED)
    return included


def delete_account(user, *, actor=None):
    """Delete the user and everything that is theirs; listeners of `account_deleting` clean up their parts.

    Args:
        user: the account to delete.
        actor: who asked (the user themselves by default, or a staff member).
    """
    with transaction.atomic():
        account_deleting.send(sender=get_user_model(), user=user, actor=actor or user)
        user.delete()


# Views
# ------------------------------------------------------------------------------


class DeleteAccountForm(forms.Form):
    password = forms.CharField(label="Your password", strip=False,
                               widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}))

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user

    def clean_password(self):
        password = self.cleaned_data["password"]
        if not self.user.check_password(password):
            raise forms.ValidationError("That is not your password.")
        return password


@login_required
@require_GET
def export_page(request):
    from serving.models import AdapterVersion

    return render(request, "account/export.html", {
        "conversations": Conversation.objects.filter(user=request.user).count(),
        "versions": AdapterVersion.objects.filter(user=request.user, state=AdapterVersion.State.READY).count(),
    })


@login_required
@require_GET
def export_conversations_view(request):
    body = json.dumps(export_conversations(request.user), ensure_ascii=False, indent=1)
    response = HttpResponse(body, content_type="application/json; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="claw-{request.user.pk}-conversations.json"'
    return response


@login_required
@require_GET
def export_adapters_view(request):
    # Spooled: small exports stay in memory, big ones go to a temp file, never all in RAM.
    spool = tempfile.SpooledTemporaryFile(max_size=32 << 20)
    write_adapters_zip(request.user, spool)
    spool.seek(0)
    return FileResponse(spool, as_attachment=True, filename=f"claw-{request.user.pk}-adapters.zip",
                        content_type="application/zip")


@login_required
def delete_page(request):
    form = DeleteAccountForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        delete_account(request.user)
        logout(request)
        messages.success(request, "Your account and its data were deleted.")
        return redirect("login")
    return render(request, "account/delete.html", {"form": form}, status=400 if form.errors else 200)

