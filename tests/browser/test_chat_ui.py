"""The chat UI in a real browser: signup to feedback, stopping, failures, dark mode, phones, XSS."""
import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from chat.models import Agent, Conversation, Feedback, Turn

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "Browser-pass-123"


def make_user(username="bea"):
    return get_user_model().objects.create_user(username=username, password=PASSWORD)


def make_agent(owner, **fields):
    fields = {"name": "Tester", "slug": "tester", "max_tokens": 200, **fields}
    return Agent.objects.create(owner=owner, **fields)


def delta_recorder(page):
    """Collects the reply.delta frames the page receives."""
    deltas = []

    def on_socket(ws):
        def on_frame(payload):
            if isinstance(payload, str) and '"reply.delta"' in payload:
                deltas.append(payload)

        ws.on("framereceived", on_frame)

    page.on("websocket", on_socket)
    return deltas


def test_signup_chat_feedback_and_reload(live_server_url, new_page, shot):
    page = new_page(live_server_url)
    deltas = delta_recorder(page)

    # 1. Sign up
    page.goto("/signup/")
    page.fill("#id_username", "newcomer")
    page.fill("#id_password1", PASSWORD)
    page.fill("#id_password2", PASSWORD)
    shot(page, "signup")
    page.click("#main button[type=submit]")
    page.wait_for_url(re.compile(r"/$"))
    expect(page.locator("h1")).to_have_text("Agents")

    # 2. Create an agent
    page.click("text=New agent")
    page.fill("#id_name", "Tutor Bot")
    page.fill("#id_system_prompt", "You are a patient tutor.")
    page.fill("#id_max_tokens", "48")
    page.select_option("#id_training_method", "combined")
    shot(page, "agent-form")
    page.click("#main button[type=submit]")
    page.wait_for_url(re.compile(r"/agents/\d+/$"))
    expect(page.locator(".agent-name")).to_contain_text("Tutor Bot")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
    agent = Agent.objects.get(name="Tutor Bot")
    assert agent.slug == "tutor-bot" and agent.owner.username == "newcomer"

    # 3. Send a message (Enter) and watch the reply stream in
    page.fill("#composer-input", "Hello, can you help me?")
    page.press("#composer-input", "Enter")
    expect(page.locator("article.msg-user .msg-content")).to_have_text("Hello, can you help me?", timeout=90_000)
    reply = page.locator("article.msg-assistant").last
    expect(reply).to_have_attribute("data-status", re.compile("complete|stopped"), timeout=60_000)
    expect(page.locator("#composer-input")).to_have_value("")
    page.wait_for_url(re.compile(r"/c/\d+/$"))
    shot(page, "reply")
    assert len(deltas) >= 2, "the reply should arrive as several deltas"
    text = reply.locator(".msg-content").inner_text()
    assert text.strip()
    expect(reply.locator(".badge-version")).to_have_text("base")
    expect(page.locator(".conv-item.active")).to_have_count(1)
    assert "Hello, can you help me?" in page.title()

    # 4. Thumb down with a reason
    reply.locator('[data-action="thumb_down"]').click()
    reply.locator(".feedback-form .chip", has_text="Too long").click()
    reply.locator(".feedback-form textarea").fill("Shorter please")
    shot(page, "thumb-form")
    reply.locator(".feedback-form button[type=submit]").click()
    expect(reply.locator('[data-action="thumb_down"]')).to_have_attribute("aria-pressed", "true")
    expect(reply.locator(".msg-feedback-note")).to_contain_text("Too long")
    shot(page, "thumbed")

    # 5. Correct the reply: the editor starts from the reply
    reply.locator('[data-action="correct"]').click()
    editor = reply.locator(".correction-form textarea")
    assert editor.input_value().strip() == Turn.objects.get(role="assistant").content.strip()
    editor.fill("Of course! What would you like to learn?")
    reply.locator(".correction-form button[type=submit]").click()
    expect(reply.locator(".msg-correction-text")).to_have_text("Of course! What would you like to learn?")
    shot(page, "corrected")

    turn = Turn.objects.get(role="assistant")
    kinds = set(Feedback.objects.filter(turn=turn, withdrawn=False).values_list("kind", flat=True))
    assert kinds == {"thumb_down", "correction"}
    assert Feedback.objects.get(turn=turn, kind="thumb_down").reason == "Too long"

    # 6. Reload: both are still shown, as saved
    page.reload()
    reply = page.locator("article.msg-assistant").last
    expect(reply).to_have_attribute("data-thumb", "thumb_down")
    expect(reply.locator('[data-action="thumb_down"]')).to_have_attribute("aria-pressed", "true")
    expect(reply.locator(".msg-correction-text")).to_have_text("Of course! What would you like to learn?")
    expect(reply.locator(".badge-version")).to_have_text("base")
    shot(page, "reloaded")


def test_thumb_can_be_withdrawn(stub_server_url, new_page, log_in):
    user = make_user()
    agent = make_agent(user)
    conversation = Conversation.objects.create(user=user, agent=agent, title="Thumbs")
    question = Turn.objects.create(conversation=conversation, role="user", content="hi", index=0)
    answer = Turn.objects.create(conversation=conversation, role="assistant", content="hello", index=1, parent=question)
    Feedback.objects.create(turn=answer, author=user, kind="thumb_up")
    page = new_page(stub_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/c/{conversation.pk}/")
    up = page.locator('article.msg-assistant [data-action="thumb_up"]')
    expect(up).to_have_attribute("aria-pressed", "true")
    up.click()
    expect(up).to_have_attribute("aria-pressed", "false")
    assert not Feedback.objects.filter(turn=answer, withdrawn=False).exists()


def test_escape_stops_generation_and_keeps_partial(stub_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user, max_tokens=400)
    page = new_page(stub_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
    page.fill("#composer-input", "Tell me a long story")
    page.press("#composer-input", "Enter")
    reply = page.locator("article.msg-assistant").last
    expect(reply.locator(".msg-content")).to_contain_text("word3", timeout=90_000)
    expect(page.locator("#stop-btn")).to_be_visible()
    shot(page, "streaming")
    page.keyboard.press("Escape")
    expect(reply).to_have_attribute("data-status", "stopped")
    expect(reply.locator(".badge-stopped")).to_have_text("stopped")
    expect(page.locator("#send-btn")).to_be_visible()
    shot(page, "stopped")
    turn = Turn.objects.get(role="assistant")
    assert turn.status == "stopped"
    assert turn.content.startswith("word0 word1 word2 word3")
    assert "word399" not in turn.content


def test_stop_button_stops_generation(stub_server_url, new_page, log_in):
    user = make_user()
    agent = make_agent(user, max_tokens=400)
    page = new_page(stub_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    page.fill("#composer-input", "Another long one")
    page.click("#send-btn")
    reply = page.locator("article.msg-assistant").last
    expect(reply.locator(".msg-content")).to_contain_text("word2", timeout=90_000)
    page.click("#stop-btn")
    expect(reply).to_have_attribute("data-status", "stopped")


def test_regenerate_keeps_the_old_reply_as_a_sibling(stub_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user)
    page = new_page(stub_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    page.fill("#composer-input", "quick question")
    page.press("#composer-input", "Enter")
    reply = page.locator("article.msg-assistant").last
    expect(reply).to_have_attribute("data-status", "complete", timeout=90_000)
    first_id = reply.get_attribute("data-turn-id")
    reply.locator('[data-action="regenerate"]').click()
    expect(page.locator("article.msg-assistant")).not_to_have_attribute("data-turn-id", first_id)
    reply = page.locator("article.msg-assistant").last
    expect(reply).to_have_attribute("data-status", "complete")
    expect(reply.locator(".sibling-nav")).to_contain_text("2/2")
    shot(page, "regenerated")
    reply.locator('[data-action="prev-sibling"]').click()
    expect(page.locator("article.msg-assistant")).to_have_attribute("data-turn-id", first_id)
    expect(page.locator(".sibling-nav")).to_contain_text("1/2")
    assert Turn.objects.filter(role="assistant").count() == 2


def test_failed_reply_shows_error_and_retry_and_keeps_the_message(stub_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user)
    page = new_page(stub_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    page.fill("#composer-input", "please FAIL now")
    page.press("#composer-input", "Enter")
    expect(page.locator("article.msg-user .msg-content")).to_have_text("please FAIL now", timeout=90_000)
    reply = page.locator("article.msg-assistant").last
    expect(reply).to_have_attribute("data-status", "failed", timeout=30_000)
    expect(reply.locator(".msg-error")).to_be_visible()
    retry = reply.locator('button[data-action="retry"]')
    expect(retry).to_be_visible()
    shot(page, "failed")
    retry.click()
    # The engine fails again for this message, but the retry went out and came back failed.
    expect(page.locator("article.msg-assistant").last).to_have_attribute("data-status", "failed")
    assert Turn.objects.filter(role="user", content="please FAIL now").count() == 1


def test_draft_survives_a_reload(stub_server_url, new_page, log_in):
    user = make_user()
    agent = make_agent(user)
    page = new_page(stub_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    page.fill("#composer-input", "half-written thought\nsecond line")
    page.wait_for_timeout(400)
    page.reload()
    expect(page.locator("#composer-input")).to_have_value("half-written thought\nsecond line")


def test_dark_mode_follows_the_os(stub_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user)
    page = new_page(stub_server_url, color_scheme="dark")
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    rgb = page.evaluate("getComputedStyle(document.body).backgroundColor")
    r, g, b = (int(x) for x in re.findall(r"\d+", rgb)[:3])
    assert r + g + b < 150, rgb
    shot(page, "dark")
    light = new_page(stub_server_url, color_scheme="light")
    light.goto("/login/")
    r, g, b = (int(x) for x in re.findall(r"\d+", light.evaluate("getComputedStyle(document.body).backgroundColor"))[:3])
    assert r + g + b > 600


def test_phone_layout_does_not_overflow(stub_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user, name="A very long agent name for a small phone screen")
    conversation = Conversation.objects.create(user=user, agent=agent, title="A conversation title that is rather long indeed")
    question = Turn.objects.create(conversation=conversation, role="user", index=0,
                                   content="averyveryveryveryverylongwordwithoutanyspacesthatcouldbreakthelayout" * 2)
    Turn.objects.create(conversation=conversation, role="assistant", index=1, parent=question,
                        content="Here is code:\n\n```python\n" + "x = 'a long line of code that must scroll inside its block' * 100\n" * 3 + "```\n\n| a | b | c | d | e |\n|---|---|---|---|---|\n| 1 | 2 | 3 | 4 | 5 |\n")
    page = new_page(stub_server_url, viewport={"width": 375, "height": 740}, is_mobile=True, has_touch=True)
    log_in(page, "bea", PASSWORD)
    for path in ["/", f"/c/{conversation.pk}/", "/settings/", f"/agents/{agent.pk}/edit/"]:
        page.goto(path)
        width = page.evaluate("document.scrollingElement.scrollWidth")
        assert width <= 375, f"{path} is {width}px wide"
        shot(page, "phone" + path.replace("/", "-"))
    page.goto(f"/c/{conversation.pk}/")
    sidebar = page.locator("#sidebar")
    expect(sidebar).not_to_be_visible()
    page.click(".sidebar-toggle")
    expect(sidebar).to_be_visible()
    expect(page.locator(".sidebar-toggle")).to_have_attribute("aria-expanded", "true")
    shot(page, "phone-sidebar")
    assert page.evaluate("document.scrollingElement.scrollWidth") <= 375
    page.keyboard.press("Escape")
    expect(sidebar).not_to_be_visible()


def test_assistant_html_renders_inert(stub_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user)
    conversation = Conversation.objects.create(user=user, agent=agent, title="<img src=x onerror=window.__xss=3>")
    question = Turn.objects.create(conversation=conversation, role="user", index=0,
                                   content="<script>window.__xss=1</script><b>bold?</b>")
    Turn.objects.create(
        conversation=conversation, role="assistant", index=1, parent=question,
        content=(
            'Look: <img src=x onerror="window.__xss=2;alert(2)">\n\n<script>window.__xss=4;alert(4)</script>\n\n'
            "[click](javascript:alert(5)) <a href=\"javascript:alert(6)\">a</a> <iframe src=\"javascript:alert(7)\"></iframe>\n\n"
            "**still markdown**"
        ),
    )
    page = new_page(stub_server_url)
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    log_in(page, "bea", PASSWORD)
    page.goto(f"/c/{conversation.pk}/")
    reply = page.locator("article.msg-assistant .msg-content")
    expect(reply.locator("strong")).to_have_text("still markdown")
    for link in reply.locator("a").all():
        link.click(modifiers=[])  # javascript: links must have been stripped
    page.wait_for_timeout(300)
    shot(page, "xss")
    assert dialogs == []
    assert page.evaluate("window.__xss") is None
    assert page.locator(".msg-content script, .msg-content img, .msg-content iframe, .conv-item img, h1 img").count() == 0
    assert page.evaluate("[...document.querySelectorAll('.msg-content *')].some(e => [...e.attributes].some(a => a.name.startsWith('on')))") is False
    assert "javascript:" not in (reply.inner_html())
    expect(page.locator("article.msg-user .msg-content")).to_have_text("<script>window.__xss=1</script><b>bold?</b>")
    expect(page.locator("#conversation-title")).to_have_text("<img src=x onerror=window.__xss=3>")


def test_settings_api_key_and_password(stub_server_url, new_page, shot, log_in):
    make_user()
    page = new_page(stub_server_url)
    page.on("dialog", lambda dialog: dialog.accept())
    log_in(page, "bea", PASSWORD)
    page.goto("/settings/")
    page.fill("#id_name", "laptop")
    page.click("text=Create key")
    key_box = page.locator("#new-key-value")
    expect(key_box).to_be_visible()
    raw = key_box.input_value()
    assert raw.startswith("claw-")
    shot(page, "key-created")
    page.reload()
    expect(page.locator("#new-key-value")).to_have_count(0)
    row = page.locator("tr", has_text="laptop")
    expect(row).to_contain_text(raw[:12])
    row.locator("button", has_text="Revoke").click()
    expect(page.locator("tr", has_text="laptop")).to_contain_text("Revoked")
    shot(page, "key-revoked")

    page.click("text=Change password")
    page.fill("#id_old_password", PASSWORD)
    page.fill("#id_new_password1", "Another-pass-456")
    page.fill("#id_new_password2", "Another-pass-456")
    page.click("#main button[type=submit]")
    expect(page.locator(".toast")).to_contain_text("Password changed")
    shot(page, "password-changed")
    page.click("text=Log out")
    page.wait_for_url(re.compile(r"/login/"))
    log_in(page, "bea", "Another-pass-456")
    expect(page.locator("h1")).to_have_text("Agents")
