"""Pages of the training app: the personalization panel and version history for users; the review
queue, version timelines, activation, pauses, audit log, plots and export for staff.

Views parse input, check permission, call one service and render. Every state change reads
the current server state by id, so a form posted from a stale page still acts on what is true now.
"""
import logging
from functools import wraps

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Count, Q
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_POST

from chat.models import Agent, Feedback
from serving.models import AdapterVersion

from . import export, plots, review, services
from .models import AuditEvent, TrainingJob, TrainingPause, TrainingSample

logger = logging.getLogger(__name__)
User = get_user_model()

def staff_required(view):
    """Anonymous users go to the login page; logged-in non-staff get 403."""

    @login_required
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_staff:
            raise PermissionDenied("Staff only.")
        return view(request, *args, **kwargs)

    return wrapper


def _next_url(request, default):
    target = request.POST.get("next") or request.GET.get("next")
    if target and url_has_allowed_host_and_scheme(target, {request.get_host()}, request.is_secure()):
        return target
    return default


def _is_htmx(request):
    return request.headers.get("HX-Request") == "true"


# Serving lookups (serving owns the registry; these only read it)
# ------------------------------------------------------------------------------


def _base_identity():
    from serving import services as serving_services

    try:
        return serving_services.base_model_identity()
    except Exception:  # the model dir is unreadable: show versions, flag none
        logger.warning("base_model_identity failed", exc_info=True)
        return None, None


def _incompatible_ids(user_id, agent_id, versions):
    from serving import services as serving_services

    finder = getattr(serving_services, "incompatible_versions_for", None)
    if finder is not None:
        return {v.pk for v in finder(user_id, agent_id)}
    name, config_hash = _base_identity()
    if config_hash is None:
        return set()
    return {v.pk for v in versions if not v.is_compatible_with(name, config_hash)}


def _active_version(user_id, agent_id):
    from serving import services as serving_services

    return serving_services.active_version_for(user_id, agent_id)


SUMMARY_METRICS = (
    ("samples_used", "samples used"), ("loss", "loss"), ("loss_ppo", "PPO loss"), ("loss_opd", "OPD loss"),
    ("loss_teacher", "teacher loss"), ("loss_kl", "KL loss"), ("reward_mean", "reward mean"),
    ("probe_kl", "KL to parent (probes)"), ("kl_to_parent", "KL to parent"), ("steps", "optimizer steps"),
    ("stopped_early", "stopped at the KL guard"), ("duration_s", "train time (s)"),
)


def _metric_rows(metrics):
    """(label, value) for the metrics a timeline shows first, then any other scalar metric."""
    def show(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    rows, seen = [], {"samples_used"}  # the timeline shows the sample count on its own
    for key, label in SUMMARY_METRICS:
        if key not in seen and metrics.get(key) is not None:
            rows.append((label, show(metrics[key])))
        seen.add(key)
    for key, value in sorted(metrics.items()):
        if key not in seen and isinstance(value, (int, float, str, bool)):
            rows.append((key.replace("_", " "), show(value)))
    return rows


def _timeline(user, agent):
    """Versions of (user, agent), newest first, with their job and what the timeline shows."""
    versions = list(
        AdapterVersion.objects.for_pair(user.pk, agent.pk)
        .select_related("parent")
        .annotate(n_samples=Count("job__samples"))
        .order_by("-number")
    )
    jobs = {j.result_version_id: j for j in TrainingJob.objects.filter(result_version__in=versions)}
    incompatible = _incompatible_ids(user.pk, agent.pk, versions)
    for v in versions:
        v.job_row = jobs.get(v.pk)
        v.sample_count = v.n_samples or v.metrics.get("samples_used") or 0
        v.metric_rows = _metric_rows(v.metrics)
        v.incompatible = v.pk in incompatible
    return versions, bool(incompatible)


def _serving_errors():
    """Errors of serving that a page reports as a message instead of failing with a 500."""
    from serving import client, services as serving_services

    names = ("AdapterIntegrityError", "IncompatibleAdapterError")
    return tuple(getattr(serving_services, n) for n in names if hasattr(serving_services, n)) + tuple(
        getattr(client, n) for n in ("InferenceUnavailable", "InferenceError") if hasattr(client, n))


def _resolve_version(raw, *, user, agent):
    """A POSTed version choice: "base" → None, else this (user, agent)'s version by id (or 404)."""
    if raw == "base":
        return None
    try:
        pk = int(raw)
    except (TypeError, ValueError):
        raise Http404("No such version.")
    return get_object_or_404(AdapterVersion, pk=pk, user=user, agent_id=agent.pk, state=AdapterVersion.State.READY)


def _activate(request, version, *, user, agent, reason):
    """Call training.services.activate and turn serving failures into a message. True on success."""
    try:
        services.activate(version, user=user, agent=agent, actor=request.user, reason=reason)
    except _serving_errors() as exc:
        logger.warning("activation of %s for u%s a%s failed", version, user.pk, agent.pk, exc_info=True)
        messages.error(request, f"Could not switch to {version.label if version else 'base'}: {exc}")
        return False
    messages.success(request, f"Now serving {version.label if version else 'the base model'}.")
    return True


# Users: the personalization panel and their own version history
# ------------------------------------------------------------------------------


def _user_agent(request, agent_id):
    return get_object_or_404(Agent.objects.visible_to(request.user), pk=agent_id)


def _panel_context(user, agent):
    versions, any_incompatible = _timeline(user, agent)
    active = _active_version(user.pk, agent.pk)
    feedback = Feedback.objects.filter(author=user, turn__conversation__agent=agent, withdrawn=False)
    counts = feedback.aggregate(
        pending=Count("id", filter=Q(status=Feedback.Status.PENDING)),
        approved=Count("id", filter=Q(status=Feedback.Status.APPROVED)),
    )
    samples = TrainingSample.objects.filter(user=user, agent=agent)
    counts["used"] = samples.filter(state=TrainingSample.State.USED).count()
    counts["ready"] = samples.filter(state=TrainingSample.State.READY).count()
    paused = services.is_training_paused(user, agent)
    job = services.open_job(user, agent)
    return {
        "agent": agent,
        "versions": versions,
        "active": active,
        "any_incompatible": any_incompatible,
        "counts": counts,
        "paused": paused,
        "job": job,
        "can_train": agent.training_enabled and not paused and counts["ready"] > 0 and job is None,
    }


@login_required
@require_GET
def panel(request, agent_id):
    agent = _user_agent(request, agent_id)
    return render(request, "training/panel.html", _panel_context(request.user, agent))


def _back_to_panel(request, agent):
    if _is_htmx(request):
        return render(request, "training/panel.html", _panel_context(request.user, agent))
    return redirect(_next_url(request, reverse("training:history", args=[agent.pk])))


@login_required
@require_POST
def train_now(request, agent_id):
    agent = _user_agent(request, agent_id)
    job = services.request_training(request.user, agent, trigger="manual", actor=request.user)
    if job is None:
        messages.info(request, "Nothing to train on right now (training off or paused, no approved samples, "
                               "or a job already queued).")
    else:
        messages.success(request, "Training job queued.")
    return _back_to_panel(request, agent)


@login_required
@require_POST
def cancel_job(request, agent_id, job_id):
    agent = _user_agent(request, agent_id)
    job = get_object_or_404(TrainingJob, pk=job_id, user=request.user, agent=agent)
    services.cancel_job(job, actor=request.user)
    messages.info(request, "Cancelling the training job.")
    return _back_to_panel(request, agent)


@login_required
@require_GET
def history(request, agent_id):
    agent = _user_agent(request, agent_id)
    return render(request, "training/history.html", _panel_context(request.user, agent))


@login_required
def activate(request, agent_id):
    """GET: confirm switching to a version (or base); POST: do it. Rollback, roll forward, reset."""
    agent = _user_agent(request, agent_id)
    raw = request.POST.get("version") if request.method == "POST" else request.GET.get("version")
    version = _resolve_version(raw, user=request.user, agent=agent)
    if request.method == "POST":
        _activate(request, version, user=request.user, agent=agent, reason=request.POST.get("reason", "").strip()
                  or "by the user")
        return redirect("training:history", agent.pk)
    return render(request, "training/confirm_activate.html", {
        "agent": agent, "version": version, "active": _active_version(request.user.pk, agent.pk),
        "action_url": reverse("training:activate", args=[agent.pk]),
    })


@login_required
@require_GET
def diff(request, agent_id, version_id):
    agent = _user_agent(request, agent_id)
    version = get_object_or_404(AdapterVersion, pk=version_id, user=request.user, agent_id=agent.pk)
    previous, rows = review.behaviour_diff(version, agent)
    return render(request, "training/diff.html", {"agent": agent, "version": version, "previous": previous,
                                                  "rows": rows, "subject": request.user})


@login_required
def delete_data(request, agent_id):
    agent = _user_agent(request, agent_id)
    if request.method == "POST":
        try:
            before = services.delete_personalization(request.user, agent, actor=request.user)
        except services.JobRunning as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Deleted {len(before['versions'])} versions and {before['samples']} samples.")
        return redirect("training:history", agent.pk)
    return render(request, "training/confirm_delete.html", _panel_context(request.user, agent))


# Staff: review queue
# ------------------------------------------------------------------------------


class QueueFilterForm(forms.Form):
    agent = forms.ModelChoiceField(queryset=Agent.objects.all(), required=False)
    user = forms.CharField(required=False, label="User (name or id)")
    kind = forms.ChoiceField(required=False, choices=[("", "any kind")] + [(k, k.replace("_", " ")) for k in review.KIND_FILTERS])
    status = forms.ChoiceField(required=False, choices=[("", "any status")] + list(Feedback.Status.choices))
    verdict = forms.ChoiceField(required=False, choices=[("", "any verdict"), ("+1", "+1"), ("-1", "-1"), ("0", "0"),
                                                         ("hint", "hint")])
    held = forms.ChoiceField(required=False, choices=[("", "held or not"), ("yes", "held only"), ("no", "not held")])
    date_from = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))
    date_to = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))

    def filters(self):
        data = self.cleaned_data
        user = None
        if data["user"]:
            raw = data["user"].strip()
            user = User.objects.filter(Q(username=raw) | Q(pk=int(raw) if raw.isdigit() else None)).first() or -1
        return {
            "agent": data["agent"], "user": user, "kind": data["kind"], "status": data["status"],
            "verdict": data["verdict"], "date_from": data["date_from"], "date_to": data["date_to"],
            "held": {"yes": True, "no": False}.get(data["held"]),
        }


@staff_required
@require_GET
def review_queue(request):
    params = request.GET.copy()
    if "status" not in params:
        params["status"] = Feedback.Status.PENDING
    form = QueueFilterForm(params)
    items = review.review_queue(**form.filters()) if form.is_valid() else Feedback.objects.none()
    page = Paginator(items, 50).get_page(request.GET.get("page"))
    now = timezone.now()
    for item in page:
        item.reserved_by_other = review.is_reserved_by_other(item, request.user, now)
        item.reserved_by_me = item.reserved_by_id == request.user.pk and item.reserved_until and item.reserved_until > now
    query = params.copy()
    query.pop("page", None)
    return render(request, "training/staff/queue.html", {
        "form": form, "page": page, "query": query.urlencode(), "here": request.get_full_path(),
    })


@staff_required
@require_POST
def review_bulk(request):
    ids = [int(i) for i in request.POST.getlist("ids") if i.isdigit()]
    note = request.POST.get("note", "").strip()
    action = request.POST.get("action")
    back = _next_url(request, reverse("training:review-queue"))
    if not ids:
        messages.error(request, "Select at least one item.")
        return redirect(back)
    if action == "approve":
        done, skipped = review.bulk_approve(ids, reviewer=request.user, note=note)
    elif action == "reject":
        if not note:
            messages.error(request, "A reject needs a note.")
            return redirect(back)
        done, skipped = review.bulk_reject(ids, reviewer=request.user, note=note)
    else:
        messages.error(request, "Unknown action.")
        return redirect(back)
    messages.success(request, f"{action.capitalize()}d {len(done)} item(s).")
    for pk, why in skipped:
        messages.warning(request, f"Skipped #{pk}: {why}")
    return redirect(back)


@staff_required
@require_GET
def review_item(request, feedback_id):
    feedback = get_object_or_404(Feedback.objects.select_related(
        "turn__conversation__agent", "turn__adapter_version", "author", "reviewer", "reserved_by", "next_turn"
    ), pk=feedback_id)
    # Opening a pending item takes it, so that two reviewers don't work the same one.
    if feedback.status == Feedback.Status.PENDING and not review.is_reserved_by_other(feedback, request.user):
        feedback = review.reserve(feedback, reviewer=request.user)
    samples = feedback.samples.all()
    return render(request, "training/staff/item.html", {
        "feedback": feedback,
        "context_turns": review.conversation_context(feedback),
        "reserved_by_other": review.is_reserved_by_other(feedback, request.user),
        "samples": samples,
        "reward_default": feedback.reward_override if feedback.reward_override is not None else
        {"thumb_up": 1.0, "thumb_down": -1.0}.get(feedback.kind, ""),
        "next": _next_url(request, reverse("training:review-queue")),
    })


def _item_action(request, feedback_id, act):
    feedback = get_object_or_404(Feedback, pk=feedback_id)
    back = _next_url(request, reverse("training:review-queue"))
    try:
        act(feedback)
    except (review.ReservedByOther, review.AlreadyReviewed) as exc:
        messages.error(request, str(exc))
        return redirect(reverse("training:review-item", args=[feedback.pk]))
    return redirect(back)


@staff_required
@require_POST
def review_reserve(request, feedback_id):
    return _item_action(request, feedback_id, lambda f: review.reserve(f, reviewer=request.user))


@staff_required
@require_POST
def review_release(request, feedback_id):
    return _item_action(request, feedback_id, lambda f: review.release(f, reviewer=request.user))


@staff_required
@require_POST
def review_approve(request, feedback_id):
    note = request.POST.get("note", "").strip()

    def act(f):
        review.approve(f, reviewer=request.user, note=note)
        messages.success(request, f"Approved #{f.pk}.")

    return _item_action(request, feedback_id, act)


class FixForm(forms.Form):
    corrected_text = forms.CharField(required=False, widget=forms.Textarea,
                                     max_length=getattr(settings, "MAX_CORRECTION_CHARS", 8000))
    reward = forms.FloatField(required=False, min_value=-1.0, max_value=1.0)
    note = forms.CharField(required=False)


@staff_required
@require_POST
def review_fix(request, feedback_id):
    form = FixForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Fix & approve: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items()))
        return redirect(reverse("training:review-item", args=[feedback_id]))
    data = form.cleaned_data
    # Only fields that were sent count as fixes; an absent field keeps what the user wrote.
    corrected = data["corrected_text"] if "corrected_text" in request.POST else None

    def act(f):
        review.approve(f, reviewer=request.user, note=data["note"].strip(), reward=data["reward"],
                       corrected_text=corrected)
        messages.success(request, f"Fixed and approved #{f.pk}.")

    return _item_action(request, feedback_id, act)


@staff_required
@require_POST
def review_reject(request, feedback_id):
    note = request.POST.get("note", "").strip()
    if not note:
        messages.error(request, "A reject needs a note.")
        return redirect(reverse("training:review-item", args=[feedback_id]))

    def act(f):
        review.reject(f, reviewer=request.user, note=note)
        messages.success(request, f"Rejected #{f.pk}.")

    return _item_action(request, feedback_id, act)


# Staff: agents, users, versions, pauses
# ------------------------------------------------------------------------------


class PolicyForm(forms.ModelForm):
    class Meta:
        model = Agent
        fields = ["review_policy"]


@staff_required
@require_GET
def staff_home(request):
    agents = Agent.objects.annotate(
        pending=Count("conversations__turns__feedback", filter=Q(conversations__turns__feedback__status="pending",
                                                                 conversations__turns__feedback__withdrawn=False))
    )
    pauses = TrainingPause.objects.select_related("user", "agent", "created_by").order_by("-created_at")
    return render(request, "training/staff/home.html", {"agents": agents, "pauses": pauses})


@staff_required
@require_GET
def staff_agent(request, agent_id):
    agent = get_object_or_404(Agent, pk=agent_id)
    pairs = (AdapterVersion.objects.filter(agent_id=agent.pk).values("user_id", "user__username")
             .annotate(versions=Count("id")).order_by("user__username"))
    learners = (TrainingSample.objects.filter(agent=agent).values("user_id", "user__username")
                .annotate(samples=Count("id")).order_by("user__username"))
    return render(request, "training/staff/agent.html", {
        "agent": agent, "form": PolicyForm(instance=agent), "pairs": pairs, "learners": learners,
        "paused": TrainingPause.objects.filter(user__isnull=True, agent=agent).exists(),
    })


@staff_required
@require_POST
def staff_agent_policy(request, agent_id):
    agent = get_object_or_404(Agent, pk=agent_id)
    before = agent.review_policy
    form = PolicyForm(request.POST, instance=agent)
    if form.is_valid():
        form.save()
        services.audit(actor=request.user, action="set_review_policy", agent_id=agent.pk, target=agent,
                       reason=request.POST.get("reason", ""), before={"review_policy": before},
                       after={"review_policy": agent.review_policy})
        messages.success(request, f"Review policy of {agent} is now “{agent.get_review_policy_display()}”.")
    else:
        messages.error(request, "Unknown review policy.")
    return redirect("training:staff-agent", agent.pk)


@staff_required
@require_GET
def staff_user(request, user_id):
    subject = get_object_or_404(User, pk=user_id)
    agent_ids = set(AdapterVersion.objects.filter(user=subject).values_list("agent_id", flat=True))
    agent_ids |= set(TrainingSample.objects.filter(user=subject).values_list("agent_id", flat=True))
    agent_ids |= set(Feedback.objects.filter(author=subject).values_list("turn__conversation__agent_id", flat=True))
    return render(request, "training/staff/user.html", {
        "subject": subject, "agents": Agent.objects.filter(pk__in=agent_ids),
        "paused": TrainingPause.objects.filter(user=subject, agent__isnull=True).exists(),
    })


@staff_required
@require_GET
def staff_history(request, user_id, agent_id):
    subject = get_object_or_404(User, pk=user_id)
    agent = get_object_or_404(Agent, pk=agent_id)
    versions, any_incompatible = _timeline(subject, agent)
    return render(request, "training/staff/history.html", {
        "subject": subject, "agent": agent, "versions": versions, "any_incompatible": any_incompatible,
        "active": _active_version(subject.pk, agent.pk), "paused": services.is_training_paused(subject, agent),
        "pair_paused": TrainingPause.objects.filter(user=subject, agent=agent).exists(),
        "job": services.open_job(subject, agent),
        "events": AuditEvent.objects.filter(subject_user_id=subject.pk, agent_id=agent.pk)[:20],
    })


@staff_required
@require_POST
def staff_activate(request, user_id, agent_id):
    subject = get_object_or_404(User, pk=user_id)
    agent = get_object_or_404(Agent, pk=agent_id)
    version = _resolve_version(request.POST.get("version"), user=subject, agent=agent)
    reason = request.POST.get("reason", "").strip()
    if not reason:
        messages.error(request, "Say why (the reason goes into the audit log).")
    else:
        _activate(request, version, user=subject, agent=agent, reason=reason)
    return redirect("training:staff-history", subject.pk, agent.pk)


@staff_required
@require_GET
def staff_diff(request, version_id):
    version = get_object_or_404(AdapterVersion.objects.select_related("user"), pk=version_id)
    agent = get_object_or_404(Agent, pk=version.agent_id)
    previous, rows = review.behaviour_diff(version, agent)
    return render(request, "training/diff.html", {"agent": agent, "version": version, "previous": previous,
                                                  "rows": rows, "subject": version.user, "staff_view": True})


def _pause_scope(request):
    user_id, agent_id = request.POST.get("user"), request.POST.get("agent")
    subject = get_object_or_404(User, pk=user_id) if user_id else None
    agent = get_object_or_404(Agent, pk=agent_id) if agent_id else None
    if subject is None and agent is None:
        raise Http404("Name a user or an agent.")
    return subject, agent


@staff_required
@require_POST
def staff_pause(request):
    subject, agent = _pause_scope(request)
    reason = request.POST.get("reason", "").strip()
    if not reason:
        messages.error(request, "Say why training is paused.")
    else:
        services.pause_training(user=subject, agent=agent, actor=request.user, reason=reason)
        messages.success(request, "Training paused.")
    return redirect(_next_url(request, reverse("training:staff-home")))


@staff_required
@require_POST
def staff_resume(request):
    subject, agent = _pause_scope(request)
    lifted = services.resume_training(user=subject, agent=agent, actor=request.user,
                                      reason=request.POST.get("reason", "").strip())
    messages.success(request, f"Training resumed ({lifted} pause(s) lifted).")
    return redirect(_next_url(request, reverse("training:staff-home")))


# Staff: audit log, plots, export
# ------------------------------------------------------------------------------


class AuditFilterForm(forms.Form):
    action = forms.CharField(required=False)
    actor = forms.CharField(required=False, label="Actor (username)")
    subject = forms.IntegerField(required=False, label="Subject user id")
    agent = forms.IntegerField(required=False, label="Agent id")
    date_from = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))
    date_to = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}))


@staff_required
@require_GET
def audit_log(request):
    form = AuditFilterForm(request.GET)
    events = AuditEvent.objects.all()
    if form.is_valid():
        data = form.cleaned_data
        if data["action"]:
            events = events.filter(action=data["action"])
        if data["actor"]:
            events = events.filter(actor_label=data["actor"])
        if data["subject"] is not None:
            events = events.filter(subject_user_id=data["subject"])
        if data["agent"] is not None:
            events = events.filter(agent_id=data["agent"])
        if data["date_from"]:
            events = events.filter(created_at__date__gte=data["date_from"])
        if data["date_to"]:
            events = events.filter(created_at__date__lte=data["date_to"])
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "training/staff/audit.html", {
        "form": form, "page": Paginator(events, 100).get_page(request.GET.get("page")), "query": query.urlencode(),
        "actions": AuditEvent.objects.order_by("action").values_list("action", flat=True).distinct(),
    })


def _optional_pk(request, name, model):
    raw = request.GET.get(name)
    if not raw:
        return None
    if not raw.isdigit():
        raise Http404(f"Bad {name}.")
    return get_object_or_404(model, pk=int(raw))


@staff_required
@require_GET
def plot(request, kind, fmt):
    if kind not in plots.KINDS or fmt not in plots.FORMATS:
        raise Http404("No such plot.")
    agent, subject = _optional_pk(request, "agent", Agent), _optional_pk(request, "user", User)
    scope = " · ".join(str(x) for x in (agent, subject) if x is not None)
    titles = {"reward": "Reward and approval rate", "volume": "Feedback volume", "jobs": "Job duration"}
    body = plots.render(kind, fmt, agent=agent, user=subject, title=f"{titles[kind]}{' — ' + scope if scope else ''}")
    response = HttpResponse(body, content_type=plots.FORMATS[fmt])
    response["Cache-Control"] = "private, max-age=60"
    return response


class ExportForm(forms.Form):
    agent = forms.IntegerField(required=False)
    user = forms.IntegerField(required=False)
    date_from = forms.DateField(required=False)
    date_to = forms.DateField(required=False)


@staff_required
@require_GET
def export_jsonl(request):
    form = ExportForm(request.GET)
    if not form.is_valid():
        return HttpResponse("Bad filter: " + form.errors.as_text(), status=400, content_type="text/plain")
    data = form.cleaned_data
    samples = export.approved_samples(agent=data["agent"], user=data["user"], date_from=data["date_from"],
                                      date_to=data["date_to"])
    services.audit(actor=request.user, action="export_samples", agent_id=data["agent"],
                   subject_user_id=data["user"],
                   after={k: str(v) for k, v in data.items() if v is not None})
    stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
    response = StreamingHttpResponse(export.iter_jsonl(samples), content_type="application/x-ndjson")
    response["Content-Disposition"] = f'attachment; filename="samples-{stamp}.jsonl"'
    return response
