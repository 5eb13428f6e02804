"""Browser pages through Django's test client: who may see what, signup, API keys, password."""
import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from chat.models import Agent, ApiKey, Conversation, Feedback, Turn

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent(user):
    return Agent.objects.create(owner=user, name="Helper", slug="helper", system_prompt="Be brief.")


@pytest.fixture
def global_agent():
    return Agent.objects.create(owner=None, name="Shared", slug="shared")


@pytest.fixture
def conversation(user, agent):
    return Conversation.objects.create(user=user, agent=agent, title="Trip plans")


@pytest.fixture
def alice(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def mallory(client, other_user):
    client.force_login(other_user)
    return client


def page_urls(agent, conversation, key_id=1):
    return [
        ("get", reverse("chat:home")),
        ("get", reverse("chat:agent_create")),
        ("get", reverse("chat:agent_chat", args=[agent.pk])),
        ("get", reverse("chat:agent_edit", args=[agent.pk])),
        ("get", reverse("chat:agent_delete", args=[agent.pk])),
        ("get", reverse("chat:conversation", args=[conversation.pk])),
        ("post", reverse("chat:conversation_rename", args=[conversation.pk])),
        ("post", reverse("chat:conversation_delete", args=[conversation.pk])),
        ("get", reverse("chat:settings")),
        ("post", reverse("chat:api_key_create")),
        ("post", reverse("chat:api_key_revoke", args=[key_id])),
        ("get", reverse("chat:password_change")),
    ]


def test_every_page_requires_login(client, agent, conversation):
    for method, url in page_urls(agent, conversation):
        response = getattr(client, method)(url)
        assert response.status_code == 302, url
        assert response.url.startswith(reverse("login") + "?next="), url


def test_login_page_renders(client):
    response = client.get(reverse("login"))
    assert response.status_code == 200
    assert b"csrfmiddlewaretoken" in response.content


def test_login_then_home(client, user, agent, global_agent):
    response = client.post(reverse("login"), {"username": "alice", "password": "pw-alice-123!"}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("chat:home")
    assert b"Helper" in response.content and b"Shared" in response.content


def test_logout_is_post_only(alice):
    assert alice.get(reverse("logout")).status_code == 405
    response = alice.post(reverse("logout"))
    assert response.status_code == 302
    assert alice.get(reverse("chat:home")).status_code == 302


def test_home_lists_only_visible_agents(alice, agent, global_agent, other_user):
    Agent.objects.create(owner=other_user, name="Mallory's secret", slug="secret")
    content = alice.get(reverse("chat:home")).content.decode()
    assert "Helper" in content and "Shared" in content
    assert "secret" not in content


def test_create_agent_sets_owner_and_slug(alice, user):
    response = alice.post(reverse("chat:agent_create"), {
        "name": "Code Reviewer", "system_prompt": "Review code.", "temperature": "0.3",
        "max_tokens": "300", "training_method": "opd", "alpha": "0.4", "training_enabled": "on",
    })
    agent = Agent.objects.get(name="Code Reviewer")
    assert response.status_code == 302
    assert response.url == reverse("chat:agent_chat", args=[agent.pk])
    assert (agent.owner, agent.slug, agent.training_method, agent.max_tokens) == (user, "code-reviewer", "opd", 300)


def test_create_agent_numbers_a_taken_slug(alice, agent):
    alice.post(reverse("chat:agent_create"), {
        "name": "Helper", "temperature": "0.7", "max_tokens": "256", "training_method": "binary", "alpha": "0.5",
    })
    assert set(Agent.objects.values_list("slug", flat=True)) == {"helper", "helper-2"}


def test_create_agent_rejects_out_of_range_temperature(alice):
    response = alice.post(reverse("chat:agent_create"), {
        "name": "Hot", "temperature": "5", "max_tokens": "256", "training_method": "binary", "alpha": "0.5",
    })
    assert response.status_code == 200
    assert not Agent.objects.filter(name="Hot").exists()


def test_review_policy_is_staff_only(alice, client, staff_user):
    assert b"review_policy" not in alice.get(reverse("chat:agent_create")).content
    client.force_login(staff_user)
    assert b"review_policy" in client.get(reverse("chat:agent_create")).content


def test_owner_edits_agent(alice, agent):
    response = alice.post(reverse("chat:agent_edit", args=[agent.pk]), {
        "name": "Helper Two", "temperature": "0.5", "max_tokens": "128", "training_method": "binary", "alpha": "0.5",
    })
    assert response.status_code == 302
    agent.refresh_from_db()
    assert (agent.name, agent.slug, agent.training_enabled) == ("Helper Two", "helper-two", False)


def test_other_user_cannot_edit_or_delete_agent(mallory, agent):
    assert mallory.get(reverse("chat:agent_edit", args=[agent.pk])).status_code == 404
    assert mallory.post(reverse("chat:agent_edit", args=[agent.pk]), {"name": "pwned"}).status_code == 404
    assert mallory.post(reverse("chat:agent_delete", args=[agent.pk])).status_code == 404
    assert Agent.objects.filter(pk=agent.pk, name="Helper").exists()


def test_nobody_edits_a_global_agent_from_the_pages(alice, global_agent):
    assert alice.get(reverse("chat:agent_edit", args=[global_agent.pk])).status_code == 404


def test_owner_deletes_agent(alice, agent):
    response = alice.post(reverse("chat:agent_delete", args=[agent.pk]))
    assert response.status_code == 302
    assert not Agent.objects.filter(pk=agent.pk).exists()


def test_other_user_cannot_chat_with_a_private_agent(mallory, agent, global_agent):
    assert mallory.get(reverse("chat:agent_chat", args=[agent.pk])).status_code == 404
    assert mallory.get(reverse("chat:agent_chat", args=[global_agent.pk])).status_code == 200


def test_other_user_gets_404_on_conversation(mallory, conversation):
    assert mallory.get(reverse("chat:conversation", args=[conversation.pk])).status_code == 404
    assert mallory.post(reverse("chat:conversation_rename", args=[conversation.pk]), {"title": "x"}).status_code == 404
    assert mallory.post(reverse("chat:conversation_delete", args=[conversation.pk])).status_code == 404
    assert Conversation.objects.filter(pk=conversation.pk).exists()


def _turn(conversation, role, content, index, parent=None, **kw):
    return Turn.objects.create(conversation=conversation, role=role, content=content, index=index, parent=parent, **kw)


def test_conversation_page_renders_saved_branch_with_feedback(alice, user, conversation):
    question = _turn(conversation, "user", "What is <b>2+2</b>?", 0)
    old = _turn(conversation, "assistant", "Five, surely.", 1, question)
    new = _turn(conversation, "assistant", "It is four.", 1, question, status="stopped")
    Feedback.objects.create(turn=new, author=user, kind="thumb_down", reason="Too long")
    Feedback.objects.create(turn=new, author=user, kind="correction", corrected_text="Four.")
    content = alice.get(reverse("chat:conversation", args=[conversation.pk])).content.decode()
    assert "What is &lt;b&gt;2+2&lt;/b&gt;?" in content
    assert "It is four." in content and f'data-turn-id="{old.pk}"' not in content
    assert 'data-thumb="thumb_down"' in content and "Too long" in content
    assert "Your correction" in content and "Four." in content
    assert "2/2" in content and ">base<" in content and "stopped" in content
    assert "<title>Trip plans · Helper · Claw</title>" in content


def test_conversation_page_marks_where_history_was_cut(alice, conversation):
    first = _turn(conversation, "user", "old question", 0)
    reply = _turn(conversation, "assistant", "old answer", 1, first)
    second = _turn(conversation, "user", "new question", 2, reply)
    _turn(conversation, "assistant", "new answer", 3, second, context_start_index=2)
    content = alice.get(reverse("chat:conversation", args=[conversation.pk])).content.decode()
    assert content.index("old answer") < content.index("History was cut here") < content.index("new question")


def test_chat_data_is_passed_as_json_script(alice, conversation):
    _turn(conversation, "user", "</script><script>alert(1)</script>", 0)
    content = alice.get(reverse("chat:conversation", args=[conversation.pk])).content.decode()
    assert '<script id="chat-data" type="application/json">' in content
    assert "<script>alert(1)</script>" not in content


def test_sidebar_groups_and_search(alice, user, agent, conversation):
    other = Conversation.objects.create(user=user, agent=agent, title="Recipes")
    _turn(other, "user", "How long to boil an egg?", 0)
    content = alice.get(reverse("chat:agent_chat", args=[agent.pk])).content.decode()
    assert "Today" in content and "Trip plans" in content and "Recipes" in content
    found = alice.get(reverse("chat:agent_chat", args=[agent.pk]), {"q": "egg"}).content.decode()
    assert "Recipes" in found and "Trip plans" not in found
    by_title = alice.get(reverse("chat:agent_chat", args=[agent.pk]), {"q": "trip"}).content.decode()
    assert "Trip plans" in by_title and "Recipes" not in by_title


def test_sidebar_shows_only_own_conversations(alice, other_user, agent, global_agent):
    Conversation.objects.create(user=other_user, agent=global_agent, title="Mallory private")
    content = alice.get(reverse("chat:agent_chat", args=[global_agent.pk])).content.decode()
    assert "Mallory private" not in content


def test_rename_and_delete_conversation(alice, conversation):
    alice.post(reverse("chat:conversation_rename", args=[conversation.pk]), {"title": "Japan trip"})
    conversation.refresh_from_db()
    assert conversation.title == "Japan trip"
    response = alice.post(reverse("chat:conversation_delete", args=[conversation.pk]))
    assert response.status_code == 302
    assert not Conversation.objects.filter(pk=conversation.pk).exists()


def test_signup_creates_account_and_logs_in(client, settings):
    settings.SIGNUP_OPEN = True
    response = client.post(reverse("signup"), {
        "username": "newbie", "email": "", "password1": "a-Long-pass-123", "password2": "a-Long-pass-123",
    })
    assert response.status_code == 302
    assert get_user_model().objects.filter(username="newbie").exists()
    assert client.get(reverse("chat:home")).status_code == 200


def test_signup_closed_says_by_invitation(client, settings):
    settings.SIGNUP_OPEN = False
    response = client.get(reverse("signup"))
    assert response.status_code == 403
    assert b"by invitation" in response.content
    client.post(reverse("signup"), {"username": "sneaky", "password1": "a-Long-pass-123", "password2": "a-Long-pass-123"})
    assert not get_user_model().objects.filter(username="sneaky").exists()


def test_invite_is_staff_only(alice):
    response = alice.get(reverse("chat:invite"))
    assert response.status_code == 302 and "/admin/login/" in response.url


def test_staff_invite_creates_user_with_set_password_link(client, staff_user):
    client.force_login(staff_user)
    response = client.post(reverse("chat:invite"), {"username": "guest", "email": "guest@example.com"})
    guest = get_user_model().objects.get(username="guest")
    assert not guest.has_usable_password()
    link = response.context["link"]
    assert "/reset/" in link
    client.logout()
    path = link.split("testserver", 1)[1]
    form_page = client.get(path, follow=True)
    assert form_page.status_code == 200 and form_page.context["validlink"]
    client.post(form_page.redirect_chain[-1][0], {"new_password1": "Fresh-pass-987", "new_password2": "Fresh-pass-987"})
    guest.refresh_from_db()
    assert guest.check_password("Fresh-pass-987")


def test_api_key_is_shown_once(alice, user):
    response = alice.post(reverse("chat:api_key_create"), {"name": "laptop"})
    assert response.status_code == 302
    key = ApiKey.objects.get(user=user)
    first = alice.get(reverse("chat:settings")).content.decode()
    raw = first.split('id="new-key-value" type="text" readonly value="', 1)[1].split('"', 1)[0]
    assert raw.startswith(key.prefix) and ApiKey.hash(raw) == key.key_hash
    second = alice.get(reverse("chat:settings")).content.decode()
    assert raw not in second and key.prefix in second and "never" in second


def test_api_key_revoke(alice, user):
    key, _ = ApiKey.objects.create_key(user, "ci")
    alice.post(reverse("chat:api_key_revoke", args=[key.pk]))
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert "Revoked" in alice.get(reverse("chat:settings")).content.decode()


def test_other_user_cannot_revoke_key(mallory, user):
    key, _ = ApiKey.objects.create_key(user, "ci")
    assert mallory.post(reverse("chat:api_key_revoke", args=[key.pk])).status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None


def test_settings_lists_only_own_keys(alice, other_user):
    ApiKey.objects.create_key(other_user, "mallory-key")
    assert "mallory-key" not in alice.get(reverse("chat:settings")).content.decode()


def test_password_change(alice, user):
    response = alice.post(reverse("chat:password_change"), {
        "old_password": "pw-alice-123!", "new_password1": "New-secret-456", "new_password2": "New-secret-456",
    })
    assert response.status_code == 302 and response.url == reverse("chat:settings")
    user.refresh_from_db()
    assert user.check_password("New-secret-456")
    # The session survives the change.
    assert alice.get(reverse("chat:settings")).status_code == 200


def test_password_change_needs_old_password(alice, user):
    alice.post(reverse("chat:password_change"), {
        "old_password": "wrong", "new_password1": "New-secret-456", "new_password2": "New-secret-456",
    })
    user.refresh_from_db()
    assert user.check_password("pw-alice-123!")


def test_forms_are_csrf_protected(user, agent):
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    assert strict.post(reverse("chat:api_key_create"), {"name": "x"}).status_code == 403
    assert strict.post(reverse("chat:agent_delete", args=[agent.pk])).status_code == 403
