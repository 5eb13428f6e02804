"""Chat verbs without inference: messages, branches, feedback rules, search and /v1 history matching."""
import pytest

from chat import services
from chat.models import Conversation, Feedback, Turn
from chat.tests.factories import (  # noqa: F401
    AgentFactory,
    ConversationFactory,
    ReplyFactory,
    TurnFactory,
    UserFactory,
    exchange,
    model_settings,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def conversation(user, model_settings):
    return ConversationFactory(user=user, agent=AgentFactory())


def test_post_user_message_saves_the_turn_and_titles_the_conversation(conversation, user):
    turn = services.post_user_message(conversation, "Hello there", user=user)
    assert Turn.objects.get(pk=turn.pk).content == "Hello there"
    assert turn.index == 0 and turn.parent_id is None
    conversation.refresh_from_db()
    assert conversation.title == "Hello there"


def test_message_after_a_reply_is_stored_as_implicit_feedback(conversation, user):
    turns = exchange(conversation, 1)
    turn = services.post_user_message(conversation, "no, shorter please", user=user)
    assert turn.parent_id == turns[-1].pk
    fb = Feedback.objects.get(kind=Feedback.Kind.IMPLICIT)
    assert (fb.turn_id, fb.next_turn_id, fb.comment, fb.author_id) == (turns[-1].pk, turn.pk, "no, shorter please", user.pk)


def test_side_turns_give_no_implicit_feedback(conversation, user):
    exchange(conversation, 1)
    services.post_user_message(conversation, "side question", user=user, turn_type=Turn.TurnType.SIDE)
    assert not Feedback.objects.exists()


def test_another_users_conversation_is_not_found(conversation, other_user):
    with pytest.raises(services.NotFound):
        services.post_user_message(conversation, "hi", user=other_user)
    with pytest.raises(services.NotFound):
        services.get_conversation(other_user, conversation.pk)
    assert not Turn.objects.exists()


def test_empty_and_oversize_messages_are_refused(conversation, user, settings):
    settings.MAX_MESSAGE_CHARS = 10
    with pytest.raises(services.InvalidInput):
        services.post_user_message(conversation, "   ", user=user)
    with pytest.raises(services.TooLarge, match="limit is 10"):
        services.post_user_message(conversation, "x" * 11, user=user)
    assert not Turn.objects.exists()


def test_message_longer_than_the_context_is_refused_before_saving(conversation, user, model_settings):
    model_settings.MODEL_MAX_CONTEXT = 48
    with pytest.raises(services.TooLarge, match="context window"):
        services.post_user_message(conversation, "word " * 200, user=user)
    assert not Turn.objects.exists()


def test_shown_branch_follows_the_latest_sibling(conversation):
    question = TurnFactory(conversation=conversation)
    old = ReplyFactory(conversation=conversation, parent=question)
    new = ReplyFactory(conversation=conversation, parent=question)
    branch = services.shown_branch(conversation)
    assert [t.pk for t in branch] == [question.pk, new.pk]
    assert branch[1].sibling_ids == [old.pk, new.pk] and branch[1].sibling_position == 2
    through_old = services.shown_branch(conversation, through=old)
    assert [t.pk for t in through_old] == [question.pk, old.pk]
    assert services.turn_payload(branch[1])["siblings"] == {"ids": [old.pk, new.pk], "count": 2, "position": 2}


@pytest.fixture
def reply(conversation):
    return exchange(conversation, 1)[-1]


def test_same_thumb_again_updates_its_reason_not_its_row(reply, user):
    up = services.record_feedback(reply, user=user, kind="thumb_down")
    again = services.record_feedback(reply, user=user, kind="thumb_down", reason="Too long", comment="shorter")
    assert again.pk == up.pk
    up.refresh_from_db()
    assert (up.reason, up.comment, up.withdrawn) == ("Too long", "shorter", False)
    assert Feedback.objects.filter(turn=reply).count() == 1


def test_thumb_flips_and_withdraws(reply, user):
    up = services.record_feedback(reply, user=user, kind="thumb_up")
    assert services.record_feedback(reply, user=user, kind="thumb_up").pk == up.pk  # same thumb: same row
    down = services.record_feedback(reply, user=user, kind="thumb_down", reason="too long")
    up.refresh_from_db()
    assert up.withdrawn and not down.withdrawn
    assert services.withdraw_thumb(reply, user).pk == down.pk
    assert not Feedback.objects.filter(withdrawn=False).exists()
    assert services.withdraw_thumb(reply, user) is None


def test_feedback_goes_on_finished_replies_only(conversation, reply, user):
    with pytest.raises(services.InvalidInput, match="replies only"):
        services.record_feedback(reply.parent, user=user, kind="thumb_up")
    streaming = ReplyFactory(conversation=conversation, parent=reply.parent, status=Turn.Status.STREAMING)
    with pytest.raises(services.InvalidInput):
        services.record_feedback(streaming, user=user, kind="thumb_up")
    with pytest.raises(services.InvalidInput):
        services.record_feedback(reply, user=user, kind="implicit")


def test_correction_needs_text_within_the_limit(reply, user, settings):
    settings.MAX_CORRECTION_CHARS = 20
    with pytest.raises(services.InvalidInput):
        services.record_feedback(reply, user=user, kind="correction")
    with pytest.raises(services.TooLarge, match="limit is 20"):
        services.record_feedback(reply, user=user, kind="correction", corrected_text="x" * 21)
    fb = services.record_feedback(reply, user=user, kind="correction", corrected_text="Better answer.")
    assert fb.corrected_text == "Better answer." and fb.status == Feedback.Status.PENDING


def test_feedback_on_another_users_turn_is_not_found(reply, other_user):
    with pytest.raises(services.NotFound):
        services.record_feedback(reply, user=other_user, kind="thumb_up")
    with pytest.raises(services.NotFound):
        services.get_turn(other_user, reply.pk)
    assert not Feedback.objects.exists()


def test_search_matches_titles_and_text_of_own_conversations(user, other_user):
    agent = AgentFactory()
    titled = ConversationFactory(user=user, agent=agent, title="Paris trip")
    texted = ConversationFactory(user=user, agent=agent)
    TurnFactory(conversation=texted, content="what about PARIS in May?")
    ConversationFactory(user=user, agent=agent, title="Other")
    ConversationFactory(user=other_user, agent=agent, title="Paris too")
    assert {c.pk for c in services.search_conversations(user, q="paris")} == {titled.pk, texted.pk}
    assert services.search_conversations(user, agent=AgentFactory()).count() == 0


def test_rename_and_delete_check_ownership(conversation, user, other_user):
    with pytest.raises(services.NotFound):
        services.rename_conversation(conversation, "x", user=other_user)
    services.rename_conversation(conversation, "  New   name ", user=user)
    assert Conversation.objects.get(pk=conversation.pk).title == "New name"
    with pytest.raises(services.NotFound):
        services.delete_conversation(conversation, user=other_user)
    services.delete_conversation(conversation, user=user)
    assert not Conversation.objects.exists()


def test_private_agent_of_another_user_is_not_found(user, other_user):
    private = AgentFactory(owner=other_user)
    with pytest.raises(services.NotFound):
        services.get_agent(user, private.pk)
    with pytest.raises(services.NotFound):
        services.create_conversation(user, private)


# /v1 history matching
# ------------------------------------------------------------------------------


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_ingest_history_stores_only_new_messages(user, model_settings):
    agent = AgentFactory()
    conversation, parent = services.ingest_history(user, agent, _msgs(("system", "sys"), ("user", "hi")), session_key="s1")
    assert [t.role for t in conversation.turns.all()] == ["system", "user"]
    ReplyFactory(conversation=conversation, parent=parent, content="hello!")
    again, parent2 = services.ingest_history(
        user, agent, _msgs(("system", "sys"), ("user", "hi"), ("assistant", "hello!"), ("user", "thanks")), session_key="s1"
    )
    assert again.pk == conversation.pk
    assert conversation.turns.count() == 4
    assert parent2.content == "thanks" and parent2.index == 3
    fb = Feedback.objects.get(kind=Feedback.Kind.IMPLICIT)
    assert fb.next_turn_id == parent2.pk


def test_ingest_history_without_session_id_derives_one(user, model_settings):
    agent = AgentFactory()
    first, p1 = services.ingest_history(user, agent, _msgs(("user", "hi")))
    ReplyFactory(conversation=first, parent=p1, content="yo")
    second, _ = services.ingest_history(user, agent, _msgs(("user", "hi"), ("assistant", "yo"), ("user", "more")))
    other, _ = services.ingest_history(user, agent, _msgs(("user", "different start")))
    assert first.pk == second.pk != other.pk
    assert first.turns.count() == 3


def test_ingest_history_edited_reply_branches(user, model_settings):
    agent = AgentFactory()
    conversation, p1 = services.ingest_history(user, agent, _msgs(("user", "hi")), session_key="s")
    ours = ReplyFactory(conversation=conversation, parent=p1, content="yo")
    _, last = services.ingest_history(
        user, agent, _msgs(("user", "hi"), ("assistant", "edited"), ("user", "ok")), session_key="s"
    )
    edited = last.parent
    assert edited.parent_id == p1.pk and edited.pk != ours.pk and edited.content == "edited"


def test_ingest_history_marks_side_turns_and_done(user, model_settings):
    agent = AgentFactory()
    conversation, parent = services.ingest_history(
        user, agent, _msgs(("user", "summarize")), session_key="x", turn_type="side", done=True
    )
    assert parent.turn_type == Turn.TurnType.SIDE
    conversation.refresh_from_db()
    assert conversation.done and conversation.source == Conversation.Source.API
