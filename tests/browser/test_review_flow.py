"""A reviewer's path in a real browser: filter the queue, fix & approve a correction, reject a
comment, open a user's version timeline, roll back to v1, and find the audit entry.

The versions are real PEFT adapters on the tiny demo model, published through serving and
hot-loaded into the built-in engine that Daphne talks to; the rollback is checked bit for bit.
"""
import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from chat.models import Agent, Conversation, Feedback, Turn
from serving.models import AdapterVersion

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "Browser-pass-123"


@pytest.fixture
def serving_settings(settings, tiny_model_dir, engine_url):
    """This process publishes and activates like Daphne does: same model, engine and adapter store."""
    settings.MODEL = str(tiny_model_dir)
    settings.INFERENCE_URLS = [engine_url]
    settings.ADAPTER_ROOT = settings.TEST_DATA_DIR / "adapters"
    settings.ADAPTER_ROOT.mkdir(parents=True, exist_ok=True)
    return settings


def off_loop(fn, *args, **kwargs):
    """Run fn in a worker thread: Playwright's sync API keeps an event loop in this one, and the
    serving client's sync calls refuse to run inside a loop."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


def publish(tiny_model_dir, tmp_path, user, agent, seed, parent=None):
    from serving.engine.testing import make_peft_adapter
    from serving.services import publish_version

    source = make_peft_adapter(tiny_model_dir, tmp_path / f"adapter-{seed}", rank=8, alpha=16, seed=seed)
    return publish_version(user_id=user.pk, agent_id=agent.pk, source_dir=source, parent=parent,
                           config={"method": "combined"}, metrics={"loss_ppo": 0.1 * seed, "samples_used": seed})


def feedback_on_new_reply(user, agent, title, kind, **fields):
    conversation = Conversation.objects.create(user=user, agent=agent, title=title)
    question = Turn.objects.create(conversation=conversation, role="user", content=f"{title}?", index=0)
    answer = Turn.objects.create(conversation=conversation, role="assistant", content=f"About {title}.", index=1,
                                 parent=question)
    return Feedback.objects.create(turn=answer, author=user, kind=kind, **fields)


def test_reviewer_fixes_rejects_and_rolls_back(serving_settings, live_server_url, new_page, shot, log_in,
                                               tiny_model_dir, tmp_path):
    from serving.client import SamplingParams, get_client
    from training import services

    users = get_user_model().objects
    users.create_user(username="rita", password=PASSWORD, is_staff=True)
    alice = users.create_user(username="alice", password=PASSWORD)
    agent = Agent.objects.create(name="Tutor", slug="tutor", batch_size=50, max_tokens=16, probe_prompts=["Hello"])
    correction = feedback_on_new_reply(alice, agent, "Paris", "correction", corrected_text="Paris is in France",
                                       hold_reason="corrections are held for review")
    comment = feedback_on_new_reply(alice, agent, "Rome", "comment", comment="asdfgh qwerty")
    v1 = publish(tiny_model_dir, tmp_path, alice, agent, seed=1)
    probe = [{"role": "user", "content": "Hello"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, seed=0)
    off_loop(services.activate, v1, user=alice, agent=agent, actor=None, reason="setup")
    v1_reply = off_loop(get_client().chat_sync, probe, adapter=v1.name, params=greedy)
    v2 = publish(tiny_model_dir, tmp_path, alice, agent, seed=2, parent=v1)
    off_loop(services.activate, v2, user=alice, agent=agent, actor=None, reason="setup")

    page = new_page(live_server_url)
    log_in(page, "rita", PASSWORD)

    # 1. The queue, filtered to corrections: the held correction shows, with its hold reason
    page.goto("/staff/review/")
    page.select_option("#id_kind", "correction")
    page.click("#queue-filters button[type=submit]")
    page.wait_for_url(re.compile(r"kind=correction"))
    rows = page.locator("tr[data-feedback-id]")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("corrections are held for review")
    shot(page, "queue-filtered")

    # 2. Fix & approve: edit the correction before approving
    rows.first.locator("text=Open").click()
    expect(page.locator(".tr-turn.reviewed")).to_contain_text("About Paris.")
    page.fill("#fix-form textarea[name=corrected_text]", "Paris is the capital of France.")
    shot(page, "fix-and-approve")
    page.click("#fix-form button[type=submit]")
    page.wait_for_url(re.compile(r"/staff/review/\?"))
    expect(page.locator(".toast")).to_contain_text(f"Fixed and approved #{correction.pk}")
    correction.refresh_from_db()
    assert correction.status == "approved" and correction.corrected_text == "Paris is the capital of France."
    assert correction.samples.get(target_text__gt="").target_text == "Paris is the capital of France."

    # 3. Reject the comment with a note
    page.goto("/staff/review/?kind=comment")
    page.locator("tr[data-feedback-id] >> text=Open").click()
    page.fill("#reject-form input[name=note]", "not about the reply")
    page.click("#reject-form button[type=submit]")
    expect(page.locator(".toast")).to_contain_text(f"Rejected #{comment.pk}")
    comment.refresh_from_db()
    assert (comment.status, comment.review_note) == ("rejected", "not about the reply")
    shot(page, "rejected")

    # 4. Alice's timeline on the agent: v2 active, v1 below it
    page.goto(f"/staff/users/{alice.pk}/agents/{agent.pk}/versions/")
    expect(page.locator(".active-version")).to_have_text("v2")
    expect(page.locator(f'li[data-version-id="{v1.pk}"]')).to_contain_text("samples: 1")
    shot(page, "timeline")

    # 5. Roll back to v1 with a reason (the page asks for confirmation)
    page.on("dialog", lambda dialog: dialog.accept())
    page.select_option("#activate-form select[name=version]", str(v1.pk))
    page.fill("#activate-form input[name=reason]", "v2 answers in the wrong language")
    page.click("#activate-form button[type=submit]")
    expect(page.locator(".active-version")).to_have_text("v1")
    shot(page, "rolled-back")
    assert list(AdapterVersion.objects.filter(is_active=True)) == [AdapterVersion.objects.get(pk=v1.pk)]
    # Exact: v1 answers token for token as it did before v2 existed.
    after = off_loop(get_client().chat_sync, probe, adapter=v1.name, params=greedy)
    assert after.token_ids == v1_reply.token_ids

    # 6. The audit log has the rollback: who, why, before and after
    page.goto("/staff/audit/?action=rollback")
    entry = page.locator('tr[data-action="rollback"]')
    expect(entry).to_have_count(1)
    expect(entry).to_contain_text("rita")
    expect(entry).to_contain_text("v2 answers in the wrong language")
    expect(entry).to_contain_text(v2.name)
    shot(page, "audit")


def test_user_rolls_back_from_the_chat_panel(serving_settings, live_server_url, new_page, shot, log_in,
                                             tiny_model_dir, tmp_path):
    from training import services
    from training.models import AuditEvent

    alice = get_user_model().objects.create_user(username="alice", password=PASSWORD)
    agent = Agent.objects.create(owner=alice, name="Coach", slug="coach", max_tokens=16)
    v1 = publish(tiny_model_dir, tmp_path, alice, agent, seed=3)
    v2 = publish(tiny_model_dir, tmp_path, alice, agent, seed=4, parent=v1)
    off_loop(services.activate, v2, user=alice, agent=agent, actor=None, reason="setup")

    page = new_page(live_server_url)
    log_in(page, "alice", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    panel = page.locator("#panel-body .claw-panel")
    expect(panel.locator(".active-version")).to_have_text("v2")
    shot(page, "panel")

    panel.locator("text=Roll back to v1").click()
    expect(page.locator("h1")).to_have_text("Roll back to v1?")
    shot(page, "confirm")
    page.click("button[name=confirm]")
    page.wait_for_url(re.compile(rf"/training/agents/{agent.pk}/versions/$"))
    expect(page.locator(".active-version")).to_have_text("v1")
    shot(page, "history")

    assert AdapterVersion.objects.get(is_active=True).pk == v1.pk
    event = AuditEvent.objects.get(action="rollback")
    assert (event.actor_label, event.before, event.after) == ("alice", {"version": v2.name}, {"version": v1.name})
