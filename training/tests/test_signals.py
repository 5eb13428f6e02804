"""Rules classifier (English and Korean), hint context, samples from feedback, review policy."""
import pytest

from training import judge, policy, services, signals
from training.models import Judgement, TrainingSample

from .factories import AgentFactory, ConversationFactory, FeedbackFactory, reply_with_context


@pytest.mark.parametrize("text", [
    "thanks!", "Perfect, that works", "great, next question", "고마워요", "완벽해", "좋아, 다음으로 넘어가자", "감사합니다",
])
def test_rules_positive(text):
    assert signals.classify_rules(text).score == 1


@pytest.mark.parametrize("text", [
    "no, I meant the other file", "that's wrong", "try again", "it doesn't work", "redo it",
    "아니, 그게 아니라 다른 파일", "틀렸어", "다시 해줘", "안 돼요", "별로야",
])
def test_rules_negative(text):
    assert signals.classify_rules(text).score == -1


@pytest.mark.parametrize("text", ["ok", "what about Germany?", "독일은?", "", "no problem"])
def test_rules_ambiguous(text):
    verdict = signals.classify_rules(text)
    assert verdict.score == 0 or text == "no problem" and verdict.score >= 0


@pytest.mark.parametrize("text, hint", [
    ("no, use ls -l", "use ls -l"),
    ("shorter please", "shorter please"),
    ("아니, 짧게 해줘", "짧게 해줘"),
    ("Thanks! Next time answer in bullet points.", "Next time answer in bullet points."),
])
def test_rules_directive_hint(text, hint):
    assert signals.classify_rules(text).hint == hint


def test_rules_no_hint_in_plain_thanks():
    assert signals.classify_rules("thank you so much").hint == ""


def test_verdict_label():
    assert signals.Verdict(score=-1, hint="x").label == "-1+hint"
    assert signals.Verdict(score=0, hint="x").label == "hint"
    assert signals.Verdict(score=1).label == "+1"


def test_append_hint_uses_openclaw_marker_on_last_user_message():
    c = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
         {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    c_prime = signals.append_hint(c, "use ls -l")
    assert c_prime[3]["content"] == "q2\n\n[user's hint / instruction]\nuse ls -l"
    assert c_prime[1]["content"] == "q1" and c[3]["content"] == "q2"  # c itself is untouched


def test_judge_parsing_and_vote():
    assert judge.parse_score("thinking... \\boxed{-1} then \\boxed{1}") == 1
    assert judge.parse_score("\\boxed{7}") is None
    assert judge.majority_vote([1, 1, -1]) == 1
    assert judge.majority_vote([1, -1, None]) == 0  # tie -> 0
    assert judge.majority_vote([None, None]) == 0
    assert judge.parse_hint("\\boxed{1} [HINT_START] use ls -l for details [HINT_END]") == "use ls -l for details"
    votes = [{"score": 1, "hint": "short"}, {"score": 1, "hint": "use ls -l to list details"},
             {"score": -1, "hint": "a much longer hint that is ignored"}]
    assert judge.best_hint(votes) == "use ls -l to list details"


# Samples
# ------------------------------------------------------------------------------


@pytest.fixture
def reply(db):
    agent = AgentFactory(system_prompt="Be brief.", review_policy="auto_all")
    return reply_with_context(ConversationFactory(agent=agent), prompt_token_ids=[1, 2], token_ids=[3, 4],
                              logprobs=[-0.1, -0.2])


def test_thumb_up_builds_one_positive_evaluative_sample(reply):
    fb = FeedbackFactory(turn=reply, kind="thumb_up")
    [sample] = signals.build_samples(fb)
    assert sample.reward == 1.0 and not sample.target_text
    assert sample.context_messages == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is the capital of France?"}]
    assert sample.provenance["feedback_id"] == fb.pk and sample.provenance["classifier"] == "explicit"


def test_correction_builds_directive_and_negative_samples(reply):
    fb = FeedbackFactory(turn=reply, kind="correction", corrected_text="Paris", comment="one word only")
    samples = signals.build_samples(fb)
    evaluative = [s for s in samples if s.is_evaluative]
    directive = [s for s in samples if s.is_directive]
    assert [s.reward for s in evaluative] == [-1.0]
    assert directive[0].target_text == "Paris"
    assert directive[0].enhanced_messages[-1]["content"].endswith("[user's hint / instruction]\none word only")


def test_comment_with_hint_builds_hint_sample(reply):
    fb = FeedbackFactory(turn=reply, kind="comment", comment="no, shorter please")
    verdict = signals.classify_rules(fb.comment)
    Judgement.objects.create(feedback=fb, classifier="rules", score=verdict.score, hint=verdict.hint)
    samples = signals.build_samples(fb)
    assert [s.reward for s in samples if s.reward] == [-1.0]
    hint_only = [s for s in samples if s.reward is None]
    assert hint_only[0].hint == "shorter please" and not hint_only[0].target_text


def test_reviewer_reward_override_zero_builds_no_evaluative_sample(reply):
    fb = FeedbackFactory(turn=reply, kind="thumb_down")
    assert services.approve_feedback(fb, reviewer=None, reward=0) == []


def test_fix_and_approve_edits_land_before_samples(reply, staff_user):
    fb = FeedbackFactory(turn=reply, kind="correction", corrected_text="Pari", status="pending")
    samples = services.approve_feedback(fb, reviewer=staff_user, corrected_text="Paris")
    assert [s.target_text for s in samples if s.is_directive] == ["Paris"]
    fb.refresh_from_db()
    assert fb.status == "approved" and fb.reviewer == staff_user


def test_reject_discards_ready_samples(reply, staff_user):
    fb = FeedbackFactory(turn=reply, kind="thumb_up")
    services.approve_feedback(fb, reviewer=None)
    services.reject_feedback(fb, reviewer=staff_user, note="spam")
    assert set(fb.samples.values_list("state", flat=True)) == {TrainingSample.State.DISCARDED}


# Review policy
# ------------------------------------------------------------------------------


@pytest.mark.parametrize("review_policy, kind, approve", [
    ("auto_all", "comment", True), ("auto_thumbs", "thumb_up", True), ("auto_thumbs", "correction", False),
    ("hold_all", "thumb_up", False),
])
def test_review_policy(db, review_policy, kind, approve):
    agent = AgentFactory(review_policy=review_policy)
    fb = FeedbackFactory(turn=reply_with_context(ConversationFactory(agent=agent)), kind=kind)
    decision, reason = policy.review_decision(fb, agent)
    assert decision is approve and (approve or reason)


def test_contradictory_thumbs_are_held(db):
    agent = AgentFactory(review_policy="auto_all")
    turn = reply_with_context(ConversationFactory(agent=agent))
    FeedbackFactory(turn=turn, kind="thumb_up", withdrawn=True)
    down = FeedbackFactory(turn=turn, kind="thumb_down")
    assert policy.review_decision(down, agent) == (False, "contradictory thumbs on the same reply")


def test_feedback_flood_is_held(db, settings):
    settings.TRAINING_HOLD_FEEDBACK_PER_HOUR = 2
    agent = AgentFactory(review_policy="auto_all")
    conversation = ConversationFactory(agent=agent)
    items = [FeedbackFactory(turn=reply_with_context(conversation), kind="comment", comment="x") for _ in range(3)]
    approve, reason = policy.review_decision(items[-1], agent)
    assert not approve and "more than 2" in reason
