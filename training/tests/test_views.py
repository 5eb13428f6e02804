"""Training pages: permissions, the panel, version history and activation, staff review and tools.

Versions are real adapters published into the store; activation, rollback, behaviour diffs and
deletion go through the real inference client to the session's engine (`serve_model` on the tiny
model), or to a port nobody listens on where a page must report serving down. The registry, the
audit log and `training.services` run for real.
"""
import re
from xml.etree import ElementTree

import httpx
import pytest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from chat.models import Agent, Feedback
from chat.tests.factories import (  # noqa: F401  (engine fixtures)
    AgentFactory,
    dead_engine,
    engine,
    engine_stats,
    live_engine,
    loaded_adapters,
    model_settings,
    unload_after,
)
from serving.adapters import adapter_path
from serving.models import AdapterVersion
from training import services
from training.models import AuditEvent, TrainingJob, TrainingPause, TrainingSample
from training.tests.test_review import make_feedback

# model_settings: versions are published for the model the engine serves.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("model_settings")]


@pytest.fixture(scope="module")
def peft_sources(tiny_model_dir, tmp_path_factory):
    """Three real PEFT adapters for the tiny model (seeds 1-3); version n is published from the nth."""
    from serving.engine.testing import make_peft_adapter

    root = tmp_path_factory.mktemp("peft")
    return [make_peft_adapter(tiny_model_dir, root / f"s{seed}", rank=8, alpha=16, seed=seed) for seed in (1, 2, 3)]


@pytest.fixture
def make_version(peft_sources):
    """`make_version(user, agent, number, active=..., compatible=..., **fields)`: publish version `number`."""
    from serving.services import publish_version

    def make(user, agent, number, *, active=False, compatible=True, **fields):
        version = publish_version(user_id=user.pk, agent_id=agent.pk,
                                  source_dir=peft_sources[(number - 1) % len(peft_sources)])
        assert version.number == number
        if not compatible:
            fields["base_model_hash"] = "f" * 64  # trained on another base model
        AdapterVersion.objects.filter(pk=version.pk).update(is_active=active, **fields)
        version.refresh_from_db()
        return version

    return make


@pytest.fixture
def replica(live_engine, unload_after):
    """The session's engine as the only replica; adapters a test loads on it go when it ends."""
    unload_after(live_engine)
    return live_engine


def load_on(server, version):
    response = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": version.name, "lora_path": version.path})
    assert response.status_code == 200, response.text


def login(client, user):
    client.force_login(user)
    return client


# Permission matrix
# ------------------------------------------------------------------------------


@pytest.fixture
def world(user, other_user, make_version):
    """A private agent of `user` with feedback and one version, and a global agent."""
    agent = AgentFactory(owner=user)
    feedback = make_feedback(user, agent, kind=Feedback.Kind.CORRECTION, corrected_text="better")
    version = make_version(user, agent, 1)
    return {"agent": agent, "feedback": feedback, "version": version, "user": user}


def staff_urls(w):
    agent, feedback, version, user = w["agent"], w["feedback"], w["version"], w["user"]
    return [
        reverse("training:staff-home"),
        reverse("training:review-queue"),
        reverse("training:review-item", args=[feedback.pk]),
        reverse("training:staff-agent", args=[agent.pk]),
        reverse("training:staff-user", args=[user.pk]),
        reverse("training:staff-history", args=[user.pk, agent.pk]),
        reverse("training:audit"),
        reverse("training:plot", args=["reward", "svg"]),
        reverse("training:export"),
    ]


def user_urls(w):
    agent, version = w["agent"], w["version"]
    return [
        reverse("training:panel", args=[agent.pk]),
        reverse("training:history", args=[agent.pk]),
        reverse("training:activate", args=[agent.pk]) + f"?version={version.pk}",
        reverse("training:delete-data", args=[agent.pk]),
    ]


def test_staff_pages_redirect_anonymous_to_login(client, world):
    for url in staff_urls(world):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("login")), url


def test_staff_pages_forbid_non_staff(client, world, other_user, user):
    for who in (other_user, user):
        login(client, who)
        for url in staff_urls(world):
            assert client.get(url).status_code == 403, url


def test_staff_pages_open_for_staff(client, world, staff_user):
    login(client, staff_user)
    for url in staff_urls(world):
        assert client.get(url).status_code == 200, url


def test_staff_posts_forbid_non_staff(client, world, user):
    login(client, user)
    feedback, agent = world["feedback"], world["agent"]
    for name, args in [("review-approve", [feedback.pk]), ("review-reject", [feedback.pk]), ("review-fix", [feedback.pk]),
                       ("review-bulk", []), ("staff-agent-policy", [agent.pk]), ("staff-pause", []),
                       ("staff-activate", [user.pk, agent.pk])]:
        assert client.post(reverse(f"training:{name}", args=args), {"note": "x"}).status_code == 403, name
    assert Feedback.objects.get(pk=feedback.pk).status == Feedback.Status.PENDING


def test_user_pages_redirect_anonymous_to_login(client, world):
    for url in user_urls(world):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith(reverse("login")), url


def test_user_pages_open_for_their_owner(client, world, user):
    login(client, user)
    for url in user_urls(world):
        assert client.get(url).status_code == 200, url
    assert client.get(reverse("training:diff", args=[world["agent"].pk, world["version"].pk])).status_code == 200


def test_user_pages_are_404_for_other_users_and_staff(client, world, other_user, staff_user):
    for who in (other_user, staff_user):
        login(client, who)
        for url in user_urls(world) + [reverse("training:diff", args=[world["agent"].pk, world["version"].pk])]:
            assert client.get(url).status_code == 404, (who, url)


def test_other_users_version_is_404_on_a_shared_agent(client, user, other_user, make_version):
    agent = AgentFactory()  # global: both may use it
    version = make_version(user, agent, 1)
    login(client, other_user)
    assert client.get(reverse("training:diff", args=[agent.pk, version.pk])).status_code == 404
    response = client.post(reverse("training:activate", args=[agent.pk]), {"version": version.pk})
    assert response.status_code == 404
    assert not AdapterVersion.objects.get(pk=version.pk).is_active


# The personalization panel
# ------------------------------------------------------------------------------


def test_panel_shows_base_counts_and_train_button(client, user, staff_user):
    agent = AgentFactory(batch_size=50)
    make_feedback(user, agent)  # pending
    approved = make_feedback(user, agent, kind=Feedback.Kind.THUMB_DOWN)
    services.approve_feedback(approved, reviewer=staff_user)
    login(client, user)

    html = client.get(reverse("training:panel", args=[agent.pk])).content.decode()

    assert 'data-version="base"' in html
    assert '<dd data-count="pending">1</dd>' in html
    assert '<dd data-count="approved">1</dd>' in html
    assert "Train now" in html
    assert "<html" not in html  # a fragment for htmx


def test_panel_hides_train_button_when_paused(client, user, staff_user):
    agent = AgentFactory(batch_size=50)
    services.approve_feedback(make_feedback(user, agent), reviewer=staff_user)
    services.pause_training(agent=agent, actor=staff_user, reason="incident")
    login(client, user)

    html = client.get(reverse("training:panel", args=[agent.pk])).content.decode()

    assert "Train now" not in html and "paused" in html


def test_panel_hides_train_button_without_ready_samples(client, user):
    agent = AgentFactory()
    login(client, user)
    assert "Train now" not in client.get(reverse("training:panel", args=[agent.pk])).content.decode()


def test_panel_shows_job_progress_and_versions(client, user, make_version):
    agent = AgentFactory()
    job = TrainingJob.objects.create(user=user, agent=agent, method="combined", state="running", progress=40)
    make_version(user, agent, 1)
    make_version(user, agent, 2, active=True)
    login(client, user)

    html = client.get(reverse("training:panel", args=[agent.pk])).content.decode()

    assert f'<progress data-job-id="{job.pk}" max="100" value="40">' in html
    assert 'data-version="u' in html and "v2" in html
    assert "Roll back to v1" in html and "Reset to base" in html


def test_panel_warns_about_incompatible_versions(client, user, make_version):
    agent = AgentFactory()
    make_version(user, agent, 1, compatible=False)
    login(client, user)
    html = client.get(reverse("training:panel", args=[agent.pk])).content.decode()
    assert "another base model" in html


def test_train_now_queues_a_manual_job(client, user, staff_user):
    agent = AgentFactory(batch_size=50)
    services.approve_feedback(make_feedback(user, agent), reviewer=staff_user)
    login(client, user)

    response = client.post(reverse("training:train-now", args=[agent.pk]), HTTP_HX_REQUEST="true")

    assert response.status_code == 200
    job = TrainingJob.objects.get(user=user, agent=agent)
    assert job.trigger == "manual"
    assert f'data-job-id="{job.pk}"' in response.content.decode()


def test_cancel_job_cancels_a_queued_job(client, user):
    agent = AgentFactory()
    job = TrainingJob.objects.create(user=user, agent=agent, method="combined")
    login(client, user)

    client.post(reverse("training:cancel-job", args=[agent.pk, job.pk]))

    job.refresh_from_db()
    assert job.state == TrainingJob.State.CANCELLED
    assert AuditEvent.objects.filter(action="cancel_job", actor=user).exists()


def test_cancel_job_of_another_user_is_404(client, user, other_user):
    agent = AgentFactory()
    job = TrainingJob.objects.create(user=user, agent=agent, method="combined")
    login(client, other_user)
    assert client.post(reverse("training:cancel-job", args=[agent.pk, job.pk])).status_code == 404


# Activation, rollback, reset (through training.services.activate)
# ------------------------------------------------------------------------------


def test_rollback_confirm_page_changes_nothing(client, user, make_version):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1)
    make_version(user, agent, 2, active=True)
    login(client, user)

    response = client.get(reverse("training:activate", args=[agent.pk]) + f"?version={v1.pk}")

    assert "Roll back to v1?" in response.content.decode()
    assert AdapterVersion.objects.get(is_active=True).number == 2


def test_user_rollback_activates_the_version_and_audits(client, user, replica, make_version):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1)
    make_version(user, agent, 2, active=True)
    login(client, user)

    response = client.post(reverse("training:activate", args=[agent.pk]), {"version": v1.pk, "reason": "v2 rambles"})

    assert response.status_code == 302
    assert list(AdapterVersion.objects.filter(is_active=True)) == [v1]
    assert v1.name in loaded_adapters(replica)  # hot-loaded before the switch
    event = AuditEvent.objects.get(action="rollback")
    assert (event.actor, event.reason) == (user, "v2 rambles")
    assert event.before == {"version": f"u{user.pk}-a{agent.pk}-v2"} and event.after == {"version": v1.name}


def test_rollback_goes_through_training_services_activate(client, user, monkeypatch, make_version):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1)
    calls = []
    monkeypatch.setattr(services, "activate", lambda version, **kw: calls.append((version, kw)))
    login(client, user)

    client.post(reverse("training:activate", args=[agent.pk]), {"version": v1.pk})

    assert calls == [(v1, {"user": user, "agent": agent, "actor": user, "reason": "by the user"})]


def test_reset_to_base_deactivates_everything_and_audits(client, user, replica, make_version,
                                                        django_capture_on_commit_callbacks):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1, active=True)
    load_on(replica, v1)  # the replica serves the active version
    login(client, user)

    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("training:activate", args=[agent.pk]), {"version": "base"})

    assert not AdapterVersion.objects.filter(is_active=True).exists()
    assert AuditEvent.objects.filter(action="reset_to_base", actor=user).exists()
    assert v1.name not in loaded_adapters(replica)  # unloaded once the switch committed


def test_rollback_from_a_stale_page_acts_on_the_current_state(client, user, replica, make_version):
    """The page was loaded when v3 was active; v2 became active since. The POST names v1 by id."""
    agent = AgentFactory()
    v1 = make_version(user, agent, 1)
    make_version(user, agent, 2, active=True)
    make_version(user, agent, 3)
    login(client, user)

    client.post(reverse("training:activate", args=[agent.pk]), {"version": v1.pk})

    assert list(AdapterVersion.objects.filter(is_active=True)) == [v1]
    assert AuditEvent.objects.get(action="rollback").before == {"version": f"u{user.pk}-a{agent.pk}-v2"}


def test_activation_failure_is_reported_not_500(client, user, dead_engine, make_version):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1)
    login(client, user)

    response = client.post(reverse("training:activate", args=[agent.pk]), {"version": v1.pk}, follow=True)

    html = response.content.decode()
    assert response.status_code == 200 and "Could not switch to v1" in html and "unreachable" in html
    assert not AdapterVersion.objects.filter(is_active=True).exists()


def test_staff_activate_requires_a_reason_and_audits(client, user, staff_user, replica, make_version):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1)
    make_version(user, agent, 2, active=True)
    login(client, staff_user)
    url = reverse("training:staff-activate", args=[user.pk, agent.pk])

    client.post(url, {"version": v1.pk})
    assert AdapterVersion.objects.get(is_active=True).number == 2
    assert v1.name not in loaded_adapters(replica)

    client.post(url, {"version": v1.pk, "reason": "complaint #12"})
    assert AdapterVersion.objects.get(is_active=True) == v1
    assert v1.name in loaded_adapters(replica)
    event = AuditEvent.objects.get(action="rollback")
    assert (event.actor, event.subject_user_id, event.reason) == (staff_user, user.pk, "complaint #12")


def test_staff_activate_rejects_a_version_of_another_pair(client, user, other_user, staff_user, make_version):
    agent = AgentFactory()
    theirs = make_version(other_user, agent, 1)
    login(client, staff_user)
    response = client.post(reverse("training:staff-activate", args=[user.pk, agent.pk]),
                           {"version": theirs.pk, "reason": "x"})
    assert response.status_code == 404


def test_staff_history_shows_metrics_and_job(client, user, staff_user, make_version):
    agent = AgentFactory()
    v1 = make_version(user, agent, 1, metrics={"loss_ppo": 0.25, "loss_opd": 1.5, "reward_mean": 0.5,
                                               "probe_kl": 0.01, "samples_used": 4}, activated_by="system")
    now = timezone.now()
    TrainingJob.objects.create(user=user, agent=agent, method="combined", state="succeeded", result_version=v1,
                               started_at=now - timezone.timedelta(seconds=12), finished_at=now)
    login(client, staff_user)

    html = client.get(reverse("training:staff-history", args=[user.pk, agent.pk])).content.decode()

    for text in ("samples: 4", "PPO loss: 0.25", "OPD loss: 1.5", "reward mean: 0.5", "KL to parent (probes): 0.01",
                 "12.0 s", "activated by system"):
        assert text in html, text


# Behaviour diff
# ------------------------------------------------------------------------------


def diff_rows(html):
    """(prompt, before, after) per row of the diff table, as rendered (HTML-escaped)."""
    return re.findall(r'<tr class="[^"]*">\s*<td>(.*?)</td>\s*<td>(.*?)</td>\s*<td>(.*?)</td>', html, flags=re.S)


def greedy(server, agent, prompt, version=None):
    """The engine's greedy reply to a probe prompt, asked directly, HTML-escaped as a page shows it."""
    body = {"model": version.name if version else "base", "temperature": 0.0, "max_tokens": agent.max_tokens,
            "messages": [{"role": "system", "content": agent.system_prompt}, {"role": "user", "content": prompt}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return escape(response.json()["choices"][0]["message"]["content"])


@pytest.mark.django_db(transaction=True)  # the client's reload hook reads the registry from another thread
def test_diff_shows_replies_side_by_side_and_caches_them(client, user, replica, make_version):
    agent = AgentFactory(probe_prompts=["Say hi", "What is 2+2?"])
    v1 = make_version(user, agent, 1)
    v2 = make_version(user, agent, 2)
    login(client, user)
    url = reverse("training:diff", args=[agent.pk, v2.pk])

    rows = diff_rows(client.get(url).content.decode())

    assert {v1.name, v2.name} <= loaded_adapters(replica)  # the client loaded both from the store
    expected = [(prompt, greedy(replica, agent, prompt, v1), greedy(replica, agent, prompt, v2))
                for prompt in agent.probe_prompts]
    assert expected[0][1] != expected[0][2]  # seeds 1 and 2 answer "Say hi" differently: the columns can't swap
    assert [row[:2] + (row[2].split("<br>")[0],) for row in rows] == expected
    generated = engine_stats(replica)["generated_tokens"]
    assert diff_rows(client.get(url).content.decode()) == rows
    assert engine_stats(replica)["generated_tokens"] == generated  # second look served from the cache


@pytest.mark.django_db(transaction=True)  # the client's reload hook reads the registry from another thread
def test_diff_of_v1_compares_with_base(client, user, staff_user, replica, make_version):
    agent = AgentFactory(probe_prompts=["Hello"])
    v1 = make_version(user, agent, 1)
    login(client, staff_user)

    html = client.get(reverse("training:staff-diff", args=[v1.pk])).content.decode()

    assert diff_rows(html) == [("Hello", greedy(replica, agent, "Hello"), greedy(replica, agent, "Hello", v1))]
    assert "vs base" in html


def test_diff_reports_serving_errors(client, user, dead_engine, make_version):
    agent = AgentFactory(probe_prompts=["Hello"])
    v1 = make_version(user, agent, 1)
    login(client, user)

    response = client.get(reverse("training:diff", args=[agent.pk, v1.pk]))

    assert response.status_code == 200
    [(prompt, before, after)] = diff_rows(response.content.decode())
    assert after.startswith("<em>unavailable</em>")
    assert "InferenceUnavailable: Inference server unreachable" in after


# Deleting personalization data
# ------------------------------------------------------------------------------


def test_delete_data_removes_samples_versions_files_and_jobs(client, user, staff_user, replica, make_version,
                                                              django_capture_on_commit_callbacks):
    agent = AgentFactory(batch_size=50)
    feedback = make_feedback(user, agent)
    services.approve_feedback(feedback, reviewer=staff_user)
    version = make_version(user, agent, 1, active=True)
    load_on(replica, version)
    TrainingJob.objects.create(user=user, agent=agent, method="combined", state="succeeded")
    login(client, user)

    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("training:delete-data", args=[agent.pk]))

    assert not TrainingSample.objects.filter(user=user, agent=agent).exists()
    assert not TrainingJob.objects.filter(user=user, agent=agent).exists()
    assert not AdapterVersion.objects.filter(user=user, agent_id=agent.pk).exists()
    assert not adapter_path(version.name).exists()
    assert version.name not in loaded_adapters(replica)
    assert Feedback.objects.filter(pk=feedback.pk).exists()  # conversations and feedback stay
    event = AuditEvent.objects.get(action="delete_personalization")
    assert event.actor == user and event.before["versions"] == [version.name]


def test_delete_data_refuses_while_a_job_runs(client, user, make_version):
    agent = AgentFactory()
    make_version(user, agent, 1)
    TrainingJob.objects.create(user=user, agent=agent, method="combined", state="running")
    login(client, user)
    client.post(reverse("training:delete-data", args=[agent.pk]))
    assert AdapterVersion.objects.filter(user=user).exists()


# Staff review pages
# ------------------------------------------------------------------------------


def test_queue_filters_by_kind(client, user, staff_user):
    agent = AgentFactory()
    thumb = make_feedback(user, agent)
    correction = make_feedback(user, agent, kind=Feedback.Kind.CORRECTION, corrected_text="x", hold_reason="held: corrections")
    login(client, staff_user)

    page = client.get(reverse("training:review-queue"), {"kind": "correction"}).context["page"]

    assert list(page) == [correction]
    assert thumb not in list(client.get(reverse("training:review-queue"), {"kind": "correction"}).context["page"])
    assert "held: corrections" in client.get(reverse("training:review-queue")).content.decode()


def test_opening_an_item_reserves_it(client, user, staff_user):
    feedback = make_feedback(user)
    login(client, staff_user)
    client.get(reverse("training:review-item", args=[feedback.pk]))
    assert Feedback.objects.get(pk=feedback.pk).reserved_by == staff_user


def test_item_reserved_by_another_cannot_be_acted_on(client, user, staff_user, django_user_model):
    from training import review

    other_staff = django_user_model.objects.create_user(username="bea", password="x", is_staff=True)
    feedback = make_feedback(user)
    review.reserve(feedback, reviewer=other_staff)
    login(client, staff_user)

    html = client.get(reverse("training:review-item", args=[feedback.pk])).content.decode()
    client.post(reverse("training:review-approve", args=[feedback.pk]))

    assert "Reserved by bea" in html and 'id="approve-form"' not in html
    assert Feedback.objects.get(pk=feedback.pk).status == Feedback.Status.PENDING


def test_fix_and_approve_view(client, user, staff_user):
    feedback = make_feedback(user, kind=Feedback.Kind.CORRECTION, corrected_text="old")
    login(client, staff_user)

    client.post(reverse("training:review-fix", args=[feedback.pk]), {"corrected_text": "new", "reward": "-0.5"})

    assert TrainingSample.objects.get(feedback=feedback, target_text__gt="").target_text == "new"
    assert TrainingSample.objects.get(feedback=feedback, reward__isnull=False).reward == -0.5


def test_reject_view_needs_a_note(client, user, staff_user):
    feedback = make_feedback(user)
    login(client, staff_user)
    client.post(reverse("training:review-reject", args=[feedback.pk]), {"note": ""})
    assert Feedback.objects.get(pk=feedback.pk).status == Feedback.Status.PENDING
    client.post(reverse("training:review-reject", args=[feedback.pk]), {"note": "off-topic"})
    assert Feedback.objects.get(pk=feedback.pk).review_note == "off-topic"


def test_bulk_view_approves_selected(client, user, staff_user):
    agent = AgentFactory(batch_size=50)
    items = [make_feedback(user, agent) for _ in range(3)]
    login(client, staff_user)
    client.post(reverse("training:review-bulk"), {"ids": [items[0].pk, items[1].pk], "action": "approve"})
    assert [Feedback.objects.get(pk=f.pk).status for f in items] == ["approved", "approved", "pending"]


def test_policy_form_sets_the_policy_and_audits(client, staff_user):
    agent = AgentFactory()
    login(client, staff_user)

    client.post(reverse("training:staff-agent-policy", args=[agent.pk]), {"review_policy": "hold_all", "reason": "x"})

    assert Agent.objects.get(pk=agent.pk).review_policy == "hold_all"
    event = AuditEvent.objects.get(action="set_review_policy")
    assert event.before == {"review_policy": "auto_thumbs"} and event.after == {"review_policy": "hold_all"}


def test_policy_form_rejects_unknown_values(client, staff_user):
    agent = AgentFactory()
    login(client, staff_user)
    client.post(reverse("training:staff-agent-policy", args=[agent.pk]), {"review_policy": "yolo"})
    assert Agent.objects.get(pk=agent.pk).review_policy == "auto_thumbs"


def test_pause_and_resume_a_user(client, user, staff_user):
    login(client, staff_user)
    client.post(reverse("training:staff-pause"), {"user": user.pk, "reason": "abuse report"})
    assert TrainingPause.objects.filter(user=user, agent__isnull=True).exists()
    client.post(reverse("training:staff-resume"), {"user": user.pk})
    assert not TrainingPause.objects.exists()
    assert [e.action for e in AuditEvent.objects.order_by("id")] == ["pause_training", "resume_training"]


def test_audit_log_filters_by_action(client, user, staff_user):
    services.audit(actor=staff_user, action="rollback", subject_user_id=user.pk, reason="because")
    services.audit(actor=staff_user, action="pause_training", reason="other")
    login(client, staff_user)
    page = client.get(reverse("training:audit"), {"action": "rollback"}).context["page"]
    assert [e.reason for e in page] == ["because"]


# Plots
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["reward", "volume", "jobs"])
def test_plots_are_valid_svg(client, user, staff_user, kind):
    agent = AgentFactory(batch_size=50)
    services.approve_feedback(make_feedback(user, agent), reviewer=staff_user)
    services.reject_feedback(make_feedback(user, agent), reviewer=staff_user, note="n")
    now = timezone.now()
    TrainingJob.objects.create(user=user, agent=agent, method="combined", state="succeeded",
                               started_at=now - timezone.timedelta(seconds=30), finished_at=now)
    login(client, staff_user)

    response = client.get(reverse("training:plot", args=[kind, "svg"]), {"agent": agent.pk, "user": user.pk})

    assert response["Content-Type"] == "image/svg+xml"
    root = ElementTree.fromstring(response.content)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_plot_without_data_is_still_an_image(client, staff_user):
    login(client, staff_user)
    response = client.get(reverse("training:plot", args=["reward", "png"]))
    assert response["Content-Type"] == "image/png" and response.content.startswith(b"\x89PNG")


def test_unknown_plot_is_404(client, staff_user):
    login(client, staff_user)
    assert client.get(reverse("training:plot", args=["nope", "svg"])).status_code == 404
