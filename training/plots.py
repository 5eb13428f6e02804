"""Server-side charts of learning per agent / per user, drawn with matplotlib (no CDN, no JS).

Uses `matplotlib.figure.Figure` directly rather than pyplot: no global state, safe in threads,
and the Agg canvas is implied.
"""
import io
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")

from django.db.models import Avg, Count, Q  # noqa: E402
from django.db.models.functions import TruncDate  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from chat.models import Feedback  # noqa: E402

from .models import TrainingJob, TrainingSample  # noqa: E402

KINDS = ("reward", "volume", "jobs")
FORMATS = {"svg": "image/svg+xml", "png": "image/png"}


def _scope(qs, *, agent_field, user_field, agent=None, user=None):
    if agent:
        qs = qs.filter(**{agent_field: agent})
    if user:
        qs = qs.filter(**{user_field: user})
    return qs


def reward_series(*, agent=None, user=None):
    """Per day: mean reward of evaluative samples, and the approval rate of reviewed feedback.

    Returns (days, reward_means, approval_days, approval_rates); a missing value is None.
    """
    samples = _scope(TrainingSample.objects.filter(reward__isnull=False), agent_field="agent",
                     user_field="user", agent=agent, user=user)
    rewards = (samples.annotate(day=TruncDate("created_at")).values("day")
               .annotate(mean=Avg("reward")).order_by("day"))
    feedback = _scope(Feedback.objects.exclude(status=Feedback.Status.PENDING),
                      agent_field="turn__conversation__agent", user_field="author", agent=agent, user=user)
    reviews = (feedback.annotate(day=TruncDate("created_at")).values("day")
               .annotate(total=Count("id"), approved=Count("id", filter=Q(status=Feedback.Status.APPROVED)))
               .order_by("day"))
    return ([r["day"] for r in rewards], [r["mean"] for r in rewards],
            [r["day"] for r in reviews], [r["approved"] / r["total"] for r in reviews])


def volume_series(*, agent=None, user=None):
    """Per day and kind: how much feedback arrived. Returns (days, {kind: [counts]})."""
    feedback = _scope(Feedback.objects.all(), agent_field="turn__conversation__agent", user_field="author",
                      agent=agent, user=user)
    rows = feedback.annotate(day=TruncDate("created_at")).values("day", "kind").annotate(n=Count("id"))
    counts = defaultdict(dict)
    for row in rows:
        counts[row["kind"]][row["day"]] = row["n"]
    days = sorted({row["day"] for row in rows})
    return days, {kind: [by_day.get(d, 0) for d in days] for kind, by_day in sorted(counts.items())}


def job_series(*, agent=None, user=None):
    """Finished jobs: (finish times, durations in seconds, states)."""
    jobs = _scope(TrainingJob.objects.filter(started_at__isnull=False, finished_at__isnull=False),
                  agent_field="agent", user_field="user", agent=agent, user=user).order_by("finished_at")
    jobs = list(jobs)
    return [j.finished_at for j in jobs], [j.duration_s for j in jobs], [j.state for j in jobs]


def _empty(ax, what):
    ax.text(0.5, 0.5, f"No {what} yet", ha="center", va="center", transform=ax.transAxes, color="#666")


def build_figure(kind, *, agent=None, user=None, title=""):
    """A matplotlib Figure for one chart kind ("reward", "volume" or "jobs")."""
    if kind not in KINDS:
        raise ValueError(f"unknown plot kind {kind!r}")
    fig = Figure(figsize=(7, 3), layout="constrained")
    ax = fig.add_subplot()
    if kind == "reward":
        days, means, review_days, rates = reward_series(agent=agent, user=user)
        if days:
            ax.plot(days, means, marker="o", label="mean reward")
        if review_days:
            ax.plot(review_days, rates, marker="s", linestyle="--", label="approval rate")
        if days or review_days:
            ax.set_ylim(-1.05, 1.05)
            ax.axhline(0, color="#bbb", linewidth=0.8)
            ax.legend(loc="lower left", fontsize="small")
        else:
            _empty(ax, "rewards or reviews")
        ax.set_title(title or "Reward and approval rate per day")
    elif kind == "volume":
        days, by_kind = volume_series(agent=agent, user=user)
        bottom = [0] * len(days)
        for k, counts in by_kind.items():
            ax.bar(days, counts, bottom=bottom, label=k)
            bottom = [b + c for b, c in zip(bottom, counts)]
        if days:
            ax.legend(loc="upper left", fontsize="small")
        else:
            _empty(ax, "feedback")
        ax.set_ylabel("feedback")
        ax.set_title(title or "Feedback volume per day")
    else:
        times, durations, states = job_series(agent=agent, user=user)
        if times:
            colors = ["tab:green" if s == "succeeded" else "tab:red" for s in states]
            ax.scatter(times, durations, c=colors)
            ax.plot(times, durations, color="#999", linewidth=0.8)
        else:
            _empty(ax, "finished jobs")
        ax.set_ylabel("seconds")
        ax.set_title(title or "Training job duration")
    fig.autofmt_xdate()
    return fig


def render(kind, fmt="svg", **kwargs):
    """Render a chart to bytes in `fmt` ("svg" or "png")."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    fig = build_figure(kind, **kwargs)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, **({"dpi": 100} if fmt == "png" else {}))
    return buffer.getvalue()
