"""Stored XSS in a real browser: hostile assistant replies, a user message, a conversation title, and
feedback text and agent names that staff read on the review pages.

tests/browser/test_chat_ui.py::test_assistant_html_renders_inert covers the basics (<img onerror>,
<script>, javascript: links, <iframe>); this file adds the rest of the usual list: <svg onload>,
HTML in code fences and fence info strings, attribute injection through markdown link and image
titles, data: and obfuscated javascript: URLs, mutation-XSS shapes, event handlers on allowed tags,
forms, <object>/<embed>/<base>/<meta>, and stored payloads on the staff pages.

Every payload sets `window.__xss` (and most call alert): the tests assert that no dialog fired,
`window.__xss` stays undefined, and no executable markup is left inside message bodies.
"""
import pytest
from django.contrib.auth import get_user_model

from chat.models import Agent, Conversation, Feedback, Turn

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "Xss-test-pass-123"

# Stored as assistant replies (rendered as markdown through marked + DOMPurify in static/js/chat.js).
ASSISTANT_PAYLOADS = [
    '<svg onload="window.__xss=1;alert(1)"><circle r="1"/></svg>',
    "<svg><script>window.__xss=2;alert(2)</script></svg>",
    '```html\n<script>window.__xss=3;alert(3)</script>\n<img src=x onerror="window.__xss=3">\n```',
    '```"><img src=x onerror=window.__xss=4>\nfenced\n```',
    '![alt](https://example.invalid/x.png "t\\" onerror=\\"window.__xss=5;alert(5)")',
    '[titled](https://example.invalid "t\\" onmouseover=\\"window.__xss=6;alert(6)")',
    '<a href="data:text/html,<script>alert(7)</script>">data link</a> '
    "[b64](data:text/html;base64,PHNjcmlwdD5hbGVydCg3KTwvc2NyaXB0Pg==)",
    "[mixed](JaVaScRiPt:window.__xss=8) [entity](&#106;avascript:window.__xss=8) "
    "<javascript:window.__xss=8> [ref][evil]\n\n[evil]: javascript:window.__xss=8",
    '<details open ontoggle="window.__xss=9;alert(9)"><summary>d</summary>x</details>',
    '<math><mtext><table><mglyph><style><img src=x onerror="window.__xss=10;alert(10)">',
    '<iframe srcdoc="<script>parent.__xss=11;parent.alert(11)</script>"></iframe>',
    '<object data="javascript:alert(12)"></object><embed src="javascript:alert(12)">',
    '<form action="javascript:alert(13)"><button formaction="javascript:alert(13)">go</button></form>',
    '<a href="#" onclick="window.__xss=14;alert(14)" id="xss-click">click me</a>',
    "<style>@import 'javascript:alert(15)';</style><div style=\"background:url(javascript:alert(15))\">styled</div>",
    '<meta http-equiv="refresh" content="0;url=javascript:alert(16)"><base href="javascript:alert(17)//">',
    '<input autofocus onfocus="window.__xss=18;alert(18)">',
    '<noscript><p title="</noscript><img src=x onerror=window.__xss=19>"></p></noscript>',
    '<a href="  javascript:alert(20)">spaces</a> <a href="java&#x09;script:alert(20)">tab</a>',
    "<scr<script>ipt>window.__xss=21</scr</script>ipt> **still markdown**",
]
USER_PAYLOAD = '<svg onload="window.__xss=100;alert(100)"></svg>[u](javascript:alert(100))'
TITLE_PAYLOAD = '"><svg onload="window.__xss=101;alert(101)">'

# No markup here may run script or load a frame, and no URL may carry a script scheme.
INERT_CHECK = """(root) => {
  const bad = [];
  for (const el of root.querySelectorAll(
      '.msg-content script, .msg-content iframe, .msg-content object, .msg-content embed, .msg-content svg,'
      + ' .msg-content math, .msg-content form, .msg-content input, .msg-content button:not(.btn),'
      + ' .msg-content style, .msg-content base, .msg-content meta, .msg-content img, .msg-content noscript')) {
    bad.push('tag ' + el.tagName);
  }
  for (const el of root.querySelectorAll('.msg-content *')) {
    for (const a of el.attributes) {
      const v = a.value.replace(/[\\s\\u0000-\\u001f]/g, '').toLowerCase();
      if (a.name.startsWith('on')) bad.push('handler ' + a.name + ' on ' + el.tagName);
      if (['href', 'src', 'action', 'formaction', 'xlink:href', 'data', 'srcdoc'].includes(a.name)
          && /^(javascript|data|vbscript):/.test(v)) bad.push('url ' + a.name + '=' + a.value);
      if (a.name === 'style') bad.push('style on ' + el.tagName);
    }
  }
  // Anywhere on the page: no element carries a handler from our payloads, no live script holds one.
  for (const el of root.querySelectorAll('*')) {
    for (const a of el.attributes) {
      if (a.name.startsWith('on') && a.value.includes('__xss')) bad.push('page handler on ' + el.tagName);
    }
  }
  for (const s of root.querySelectorAll('script')) {
    if ((s.type || '').includes('json')) continue;
    if (s.textContent.includes('__xss')) bad.push('live script with a payload');
  }
  return bad;
}"""


def make_user(username, **fields):
    return get_user_model().objects.create_user(username=username, password=PASSWORD, **fields)


def watch(page):
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    return dialogs


def assert_inert(page, dialogs):
    page.wait_for_timeout(300)  # let onload/onerror/ontoggle/autofocus handlers fire, if any survived
    assert dialogs == []
    assert page.evaluate("typeof window.__xss") == "undefined"
    assert page.evaluate(f"({INERT_CHECK})(document)") == []


@pytest.fixture
def hostile_conversation():
    user = make_user("xena")
    agent = Agent.objects.create(owner=user, name="Echo", slug="echo", max_tokens=16)
    conversation = Conversation.objects.create(user=user, agent=agent, title=TITLE_PAYLOAD)
    parent, index, replies = None, 0, []
    for i, payload in enumerate(ASSISTANT_PAYLOADS):
        question = Turn.objects.create(conversation=conversation, role="user", index=index, parent=parent,
                                       content=USER_PAYLOAD if i == 0 else f"question {i}")
        parent = Turn.objects.create(conversation=conversation, role="assistant", index=index + 1, parent=question,
                                     content=payload)
        replies.append(parent)
        index += 2
    return {"user": user, "agent": agent, "conversation": conversation, "replies": replies}


def test_hostile_replies_title_and_user_message_render_inert(live_server_url, new_page, shot, log_in,
                                                            hostile_conversation):
    page = new_page(live_server_url)
    dialogs = watch(page)
    log_in(page, "xena", PASSWORD)
    page.goto(f"/c/{hostile_conversation['conversation'].pk}/")
    replies = page.locator("article.msg-assistant .msg-content")
    assert replies.count() == len(ASSISTANT_PAYLOADS)
    # Markdown still renders; code fences show the HTML as text.
    assert page.locator("article.msg-assistant .msg-content strong", has_text="still markdown").count() == 1
    code = page.locator("article.msg-assistant .msg-content pre code").first
    assert "<script>window.__xss=3" in code.inner_text()
    # The attacker's text is visible as text in the user message and the title, never as markup.
    assert page.locator("article.msg-user .msg-content").first.inner_text().startswith("<svg onload=")
    assert page.locator("#conversation-title").inner_text() == TITLE_PAYLOAD
    # Interact the way a person would: hover the titled link, click the link that had onclick.
    for link in replies.locator("a").all():
        link.hover()
    clickable = page.locator("#xss-click, .msg-content a:has-text('click me')")
    if clickable.count():
        clickable.first.click()
    shot(page, "hostile-replies")
    assert_inert(page, dialogs)
    # A reload goes through the server-rendered data once more.
    page.reload()
    assert_inert(page, dialogs)


def test_payloads_in_feedback_and_agent_names_are_inert_on_staff_pages(live_server_url, new_page, shot, log_in,
                                                                       hostile_conversation):
    """Users write feedback and name their agents; staff read both. Nothing of it may run there."""
    make_user("stella", is_staff=True)
    agent = hostile_conversation["agent"]
    agent.name = '<img src=x onerror="window.__xss=200;alert(200)">'
    agent.save()
    reply = hostile_conversation["replies"][0]
    correction = Feedback.objects.create(
        turn=reply, author=hostile_conversation["user"], kind=Feedback.Kind.CORRECTION,
        corrected_text='<script>window.__xss=201;alert(201)</script>', comment='<svg onload="window.__xss=202">')
    Feedback.objects.create(turn=hostile_conversation["replies"][1], author=hostile_conversation["user"],
                            kind=Feedback.Kind.THUMB_DOWN, reason='"><img src=x onerror=window.__xss=203>')
    page = new_page(live_server_url)
    dialogs = watch(page)
    log_in(page, "stella", PASSWORD)
    for url in ("/staff/", "/staff/review/?status=", f"/staff/review/{correction.pk}/", f"/staff/agents/{agent.pk}/",
                f"/staff/users/{hostile_conversation['user'].pk}/"):
        page.goto(url)
        assert page.locator("body").inner_text()  # the page rendered
        assert_inert(page, dialogs)
    page.goto(f"/staff/review/{correction.pk}/")
    assert "<script>window.__xss=201" in page.locator("body").inner_text()  # shown as text
    shot(page, "staff-review-item")
