"""Prompt building and context-window truncation, with the tiny model's real tokenizer."""
import pytest

from chat import context
from chat.models import Turn
from chat.tests.factories import AgentFactory, ConversationFactory, TurnFactory, exchange, model_settings  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture
def conversation(user):
    return ConversationFactory(user=user, agent=AgentFactory(system_prompt="Be brief.", max_tokens=16))


def test_short_history_is_kept_whole(model_settings, conversation):
    turns = exchange(conversation, 2)
    last = TurnFactory(conversation=conversation, parent=turns[-1], content="and now?")
    prompt = context.build_prompt(conversation.agent, turns + [last])
    assert prompt.messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in prompt.messages[1:]] == [t.content for t in turns + [last]]
    assert prompt.context_start_index is None


def test_long_history_keeps_system_and_newest_turns(model_settings, conversation):
    model_settings.MODEL_MAX_CONTEXT = 160
    turns = exchange(conversation, 12, words=2)
    last = TurnFactory(conversation=conversation, parent=turns[-1], content="final question")
    prompt = context.build_prompt(conversation.agent, turns + [last])
    assert prompt.messages[0]["role"] == "system"
    assert prompt.messages[-1]["content"] == "final question"
    kept = prompt.messages[1:]
    assert 3 <= len(kept) < len(turns) + 1
    assert kept[0]["role"] == "user"  # never starts with a reply whose question was cut
    first_kept = next(t for t in turns if t.content == kept[0]["content"])
    assert prompt.context_start_index == first_kept.index
    assert prompt.kept_turn_ids[0] == first_kept.pk
    assert prompt.prompt_tokens + prompt.max_tokens <= 160
    assert context.count_tokens(prompt.messages) == prompt.prompt_tokens


def test_failed_and_empty_replies_are_left_out(model_settings, conversation):
    first = TurnFactory(conversation=conversation, content="hi")
    failed = TurnFactory(conversation=conversation, parent=first, role=Turn.Role.ASSISTANT, content="", status=Turn.Status.FAILED)
    second = TurnFactory(conversation=conversation, parent=failed, content="hello?")
    prompt = context.build_prompt(conversation.agent, [first, failed, second])
    assert [m["role"] for m in prompt.messages] == ["system", "user", "user"]


def test_single_message_longer_than_context_is_refused(model_settings, conversation):
    model_settings.MODEL_MAX_CONTEXT = 64
    with pytest.raises(context.ContextTooLong, match="too long"):
        context.check_message_fits(conversation.agent, "word " * 500)


def test_reply_budget_never_takes_the_whole_window(model_settings, conversation):
    model_settings.MODEL_MAX_CONTEXT = 64
    conversation.agent.max_tokens = 4096
    turn = TurnFactory(conversation=conversation, content="hi")
    prompt = context.build_prompt(conversation.agent, [turn])
    assert 1 <= prompt.max_tokens <= 32
    assert prompt.prompt_tokens + prompt.max_tokens <= 64


def test_context_length_reads_the_model_config(model_settings):
    assert context.context_length() == 512
    model_settings.MODEL_MAX_CONTEXT = 100
    assert context.context_length() == 100


def test_missing_tokenizer_falls_back_to_an_estimate(settings, tmp_path):
    settings.MODEL = str(tmp_path / "nowhere")
    assert context.count_tokens([{"role": "user", "content": "x" * 300}]) >= 100
