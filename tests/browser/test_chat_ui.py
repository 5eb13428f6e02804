"""The chat UI in a real browser: signup to feedback, stopping, failures, dark mode, phones, XSS.

Every reply comes from the built-in engine serving the tiny demo model (see conftest.py).
"""
import json
import re
import time

import httpx
import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from chat.models import Agent, Conversation, Feedback, Turn

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "Browser-pass-123"
# With this system prompt and at temperature 0, the tiny model answers LONG_PROMPT up to max_tokens
# without an end-of-sequence token (most prompts end after a dozen tokens or so), so the reply
# streams for about 13 s at conftest.STEP_DELAY: long enough to be stopped.
LONG_PROMPT = "Count to one hundred."
LONG_AGENT = {"system_prompt": "You are a helpful assistant.", "temperature": 0.0, "max_tokens": 256}


def make_user(username="bea"):
    return get_user_model().objects.create_user(username=username, password=PASSWORD)


def make_agent(owner, **fields):
    fields = {"name": "Tester", "slug": "tester", "max_tokens": 200, **fields}
    return Agent.objects.create(owner=owner, **fields)


def frame_recorder(page):
    """Collects the JSON frames the page's sockets receive, in order."""
    frames = []

    def on_socket(ws):
        def on_frame(payload):
            if isinstance(payload, str):
                try:
                    frames.append(json.loads(payload))
                except ValueError:
                    pass

        ws.on("framereceived", on_frame)

    page.on("websocket", on_socket)
    return frames


def deltas(frames, turn_id=None):
    return [f for f in list(frames) if f.get("type") == "reply.delta" and turn_id in (None, f.get("turn_id"))]


def streamed_text(frames, turn_id):
    """What the page was streamed for the reply `turn_id`: its reply.delta texts, joined."""
    return "".join(f.get("text") or "" for f in deltas(frames, turn_id))


def done_turn(frames, turn_id):
    """The turn as the last reply.done frame for `turn_id` gave it to the page."""
    return [f for f in list(frames) if f.get("type") == "reply.done" and f["turn"]["id"] == turn_id][-1]["turn"]


def wait_for_deltas(page, frames, count, timeout_s=90):
    """Wait until the page has received `count` reply.delta frames (the reply is streaming)."""
    deadline = time.monotonic() + timeout_s
    while len(deltas(frames)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} reply.delta frames after {timeout_s} s"
        page.wait_for_timeout(20)  # Playwright delivers the frame events while it waits


def greedy_reference(engine_url, turn, max_tokens):
    """The engine's greedy answer to the prompt of `turn` (the first reply of a conversation)."""
    messages = [{"role": "system", "content": turn.conversation.agent.system_prompt},
                {"role": "user", "content": turn.parent.content}]
    body = {"model": turn.sampling_params["model"], "messages": messages, "temperature": 0.0,
            "max_tokens": max_tokens, "return_token_ids": True}
    response = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def test_signup_chat_feedback_and_reload(live_server_url, new_page, shot):
    page = new_page(live_server_url)
    frames = frame_recorder(page)

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
    assert len(deltas(frames)) >= 2, "the reply should arrive as several deltas"
    text = reply.locator(".msg-content").inner_text()
    assert text.strip()
    saved = Turn.objects.get(role="assistant")
    assert saved.status == "complete" and saved.token_ids and saved.prompt_token_ids
    assert streamed_text(frames, saved.pk) == saved.content == done_turn(frames, saved.pk)["content"]
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


def test_thumb_can_be_withdrawn(live_server_url, new_page, log_in):
    user = make_user()
    agent = make_agent(user)
    conversation = Conversation.objects.create(user=user, agent=agent, title="Thumbs")
    question = Turn.objects.create(conversation=conversation, role="user", content="hi", index=0)
    answer = Turn.objects.create(conversation=conversation, role="assistant", content="hello", index=1, parent=question)
    Feedback.objects.create(turn=answer, author=user, kind="thumb_up")
    page = new_page(live_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/c/{conversation.pk}/")
    up = page.locator('article.msg-assistant [data-action="thumb_up"]')
    expect(up).to_have_attribute("aria-pressed", "true")
    up.click()
    expect(up).to_have_attribute("aria-pressed", "false")
    assert not Feedback.objects.filter(turn=answer, withdrawn=False).exists()


def test_escape_stops_generation_and_keeps_partial(live_server_url, engine_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user, **LONG_AGENT)
    page = new_page(live_server_url)
    frames = frame_recorder(page)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
    page.fill("#composer-input", LONG_PROMPT)
    page.press("#composer-input", "Enter")
    reply = page.locator("article.msg-assistant").last
    wait_for_deltas(page, frames, 4)
    expect(reply).to_have_attribute("data-status", "streaming")
    expect(reply.locator(".msg-content")).to_have_text(re.compile(r"\S"))
    expect(page.locator("#stop-btn")).to_be_visible()
    shot(page, "streaming")
    page.keyboard.press("Escape")
    expect(reply).to_have_attribute("data-status", "stopped")
    expect(reply.locator(".badge-stopped")).to_have_text("stopped")
    expect(page.locator("#send-btn")).to_be_visible()
    shot(page, "stopped")

    turn = Turn.objects.select_related("parent", "conversation__agent").get(role="assistant")
    assert turn.status == "stopped"
    # Stopped means stopped: nothing more streams in, nothing more is saved.
    received = len(deltas(frames))
    page.wait_for_timeout(500)  # ten engine steps (conftest.STEP_DELAY)
    assert len(deltas(frames)) == received
    turn.refresh_from_db()
    assert turn.status == "stopped"
    # The partial reply is kept as it was streamed to the page, cut well before max_tokens...
    assert 4 <= len(turn.token_ids) < LONG_AGENT["max_tokens"]
    streamed = streamed_text(frames, turn.pk)
    assert streamed and turn.content.startswith(streamed)
    assert done_turn(frames, turn.pk)["content"] == turn.content
    # ...and it is exactly the beginning of what the model says to this prompt, which goes on
    # after the point where it was stopped. (How long the tiny model's reply runs depends on the
    # weights this machine's build trained, so the test asks only that it was cut short.)
    reference = greedy_reference(engine_url, turn, max_tokens=LONG_AGENT["max_tokens"])
    assert reference["prompt_token_ids"] == turn.prompt_token_ids
    choice = reference["choices"][0]
    assert len(choice["token_ids"]) > len(turn.token_ids)
    assert choice["token_ids"][:len(turn.token_ids)] == turn.token_ids
    assert choice["message"]["content"].startswith(turn.content)


def test_stop_button_stops_generation(live_server_url, new_page, log_in):
    user = make_user()
    agent = make_agent(user, **LONG_AGENT)
    page = new_page(live_server_url)
    frames = frame_recorder(page)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    page.fill("#composer-input", LONG_PROMPT)
    page.click("#send-btn")
    reply = page.locator("article.msg-assistant").last
    wait_for_deltas(page, frames, 3)
    expect(reply.locator(".msg-content")).to_have_text(re.compile(r"\S"))
    page.click("#stop-btn")
    expect(reply).to_have_attribute("data-status", "stopped")
    expect(page.locator("#send-btn")).to_be_visible()
    turn = Turn.objects.get(role="assistant")
    assert turn.status == "stopped" and 3 <= len(turn.token_ids) < LONG_AGENT["max_tokens"]
    assert turn.content.startswith(streamed_text(frames, turn.pk)) and turn.content.strip()


def test_regenerate_keeps_the_old_reply_as_a_sibling(live_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user, max_tokens=32)
    page = new_page(live_server_url)
    frames = frame_recorder(page)
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
    second_id = reply.get_attribute("data-turn-id")
    shot(page, "regenerated")
    reply.locator('[data-action="prev-sibling"]').click()
    expect(page.locator("article.msg-assistant")).to_have_attribute("data-turn-id", first_id)
    expect(page.locator(".sibling-nav")).to_contain_text("1/2")
    first, second = (Turn.objects.get(pk=int(i)) for i in (first_id, second_id))
    assert Turn.objects.filter(role="assistant").count() == 2
    assert first.parent_id == second.parent_id
    for turn in (first, second):
        assert turn.status == "complete" and turn.token_ids
        assert streamed_text(frames, turn.pk) == turn.content == done_turn(frames, turn.pk)["content"]


def test_failed_reply_shows_error_and_retry_and_keeps_the_message(restartable_server, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user, max_tokens=24)
    page = new_page(restartable_server.url)
    frames = frame_recorder(page)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
    restartable_server.engine.stop()  # the model server crashes: connections are refused
    page.fill("#composer-input", "Are you still there?")
    page.press("#composer-input", "Enter")
    expect(page.locator("article.msg-user .msg-content")).to_have_text("Are you still there?", timeout=90_000)
    reply = page.locator("article.msg-assistant").last
    expect(reply).to_have_attribute("data-status", "failed", timeout=30_000)
    expect(reply.locator(".msg-error")).to_be_visible()
    expect(reply.locator(".msg-error")).to_contain_text("unavailable")
    retry = reply.locator('button[data-action="retry"]')
    expect(retry).to_be_visible()
    expect(page.locator("#composer-input")).to_have_value("")
    shot(page, "failed")
    failed = Turn.objects.get(role="assistant")
    assert failed.status == "failed" and "unavailable" in failed.error and failed.content == ""

    restartable_server.engine.start()  # back, on the same port
    retry.click()
    reply = page.locator("article.msg-assistant").last
    expect(reply).not_to_have_attribute("data-turn-id", str(failed.pk))
    expect(reply).to_have_attribute("data-status", "complete", timeout=60_000)
    expect(reply.locator(".msg-error")).to_have_count(0)
    expect(reply.locator(".sibling-nav")).to_contain_text("2/2")
    shot(page, "retried")
    retried = Turn.objects.get(pk=int(reply.get_attribute("data-turn-id")))
    assert retried.status == "complete" and retried.parent_id == failed.parent_id
    assert retried.token_ids and streamed_text(frames, retried.pk) == retried.content
    # The message was stored once and kept; the failed reply stays as a sibling.
    assert Turn.objects.filter(role="user", content="Are you still there?").count() == 1
    failed.refresh_from_db()
    assert failed.status == "failed"
    assert Turn.objects.filter(role="assistant").count() == 2


def test_draft_survives_a_reload(live_server_url, new_page, log_in):
    user = make_user()
    agent = make_agent(user)
    page = new_page(live_server_url)
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    page.fill("#composer-input", "half-written thought\nsecond line")
    page.wait_for_timeout(400)
    page.reload()
    expect(page.locator("#composer-input")).to_have_value("half-written thought\nsecond line")


def test_dark_mode_follows_the_os(live_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user)
    page = new_page(live_server_url, color_scheme="dark")
    log_in(page, "bea", PASSWORD)
    page.goto(f"/agents/{agent.pk}/")
    rgb = page.evaluate("getComputedStyle(document.body).backgroundColor")
    r, g, b = (int(x) for x in re.findall(r"\d+", rgb)[:3])
    assert r + g + b < 150, rgb
    shot(page, "dark")
    light = new_page(live_server_url, color_scheme="light")
    light.goto("/login/")
    r, g, b = (int(x) for x in re.findall(r"\d+", light.evaluate("getComputedStyle(document.body).backgroundColor"))[:3])
    assert r + g + b > 600


def test_phone_layout_does_not_overflow(live_server_url, new_page, shot, log_in):
    user = make_user()
    agent = make_agent(user, name="A very long agent name for a small phone screen")
    conversation = Conversation.objects.create(user=user, agent=agent, title="A conversation title that is rather long indeed")
    question = Turn.objects.create(conversation=conversation, role="user", index=0,
                                   content="averyveryveryveryverylongwordwithoutanyspacesthatcouldbreakthelayout" * 2)
    Turn.objects.create(conversation=conversation, role="assistant", index=1, parent=question,
                        content="Here is code:\n\n```python\n" + "x = 'a long line of code that must scroll inside its block' * 100\n" * 3 + "```\n\n| a | b | c | d | e |\n|---|---|---|---|---|\n| 1 | 2 | 3 | 4 | 5 |\n")
    page = new_page(live_server_url, viewport={"width": 375, "height": 740}, is_mobile=True, has_touch=True)
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


def test_assistant_html_renders_inert(live_server_url, new_page, shot, log_in):
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
    page = new_page(live_server_url)
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


def test_settings_api_key_and_password(live_server_url, new_page, shot, log_in):
    make_user()
    page = new_page(live_server_url)
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
