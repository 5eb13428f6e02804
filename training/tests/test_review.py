"""Review actions (training/review.py) on real rows: approve, fix & approve, reject, bulk, reservations."""
from datetime import timedelta

import pytest
from django.utils import timezone

from chat.models import Feedback
from chat.tests.factories import AgentFactory, ConversationFactory, FeedbackFactory, exchange
from training import review
from training.models import AuditEvent, TrainingSample

pytestmark = pytest.mark.django_db


def make_feedback(user, agent=None, *, kind=Feedback.Kind.THUMB_UP, **fields):
    """Feedback by `user` on the last reply of a fresh two-exchange conversation."""
    agent = agent or AgentFactory()
    conversation = ConversationFactory(user=user, agent=agent)
    reply = exchange(conversation, 2)[-1]
    return FeedbackFactory(turn=reply, author=user, kind=kind, **fields)


@pytest.fixture
def staff_b(django_user_model):
    return django_user_model.objects.create_user(username="bea", password="pw-bea-123!", is_staff=True)


def test_approve_builds_samples_and_audits(user, staff_user):
    feedback = make_feedback(user, kind=Feedback.Kind.THUMB_DOWN)

    samples = review.approve(feedback, reviewer=staff_user, note="fine")

    feedback.refresh_from_db()
    assert feedback.status == Feedback.Status.APPROVED
    assert feedback.reviewer == staff_user
    assert [s.reward for s in samples] == [-1.0]
    assert AuditEvent.objects.filter(action="approve_feedback", actor=staff_user, target_id=str(feedback.pk)).exists()


def test_fix_and_approve_changes_target_and_reward(user, staff_user):
    feedback = make_feedback(user, kind=Feedback.Kind.CORRECTION, corrected_text="Paris is in France.")

    samples = review.approve(feedback, reviewer=staff_user, reward=-0.5, corrected_text="Paris is the capital of France.")

    directive = [s for s in samples if s.target_text]
    evaluative = [s for s in samples if s.reward is not None]
    assert [s.target_text for s in directive] == ["Paris is the capital of France."]
    assert [s.reward for s in evaluative] == [-0.5]
    feedback.refresh_from_db()
    assert feedback.corrected_text == "Paris is the capital of France."
    assert feedback.reward_override == -0.5


def test_reject_keeps_note_and_builds_no_sample(user, staff_user):
    feedback = make_feedback(user, kind=Feedback.Kind.COMMENT, comment="lol")

    review.reject(feedback, reviewer=staff_user, note="not feedback about the reply")

    feedback.refresh_from_db()
    assert feedback.status == Feedback.Status.REJECTED
    assert feedback.review_note == "not feedback about the reply"
    assert not TrainingSample.objects.filter(feedback=feedback).exists()
    assert AuditEvent.objects.get(action="reject_feedback").reason == "not feedback about the reply"


def test_acting_twice_raises_already_reviewed(user, staff_user):
    feedback = make_feedback(user)
    review.reject(feedback, reviewer=staff_user, note="no")

    with pytest.raises(review.AlreadyReviewed):
        review.approve(feedback, reviewer=staff_user)


def test_bulk_approve_approves_all_pending(user, staff_user):
    agent = AgentFactory(batch_size=50)
    items = [make_feedback(user, agent) for _ in range(3)]

    done, skipped = review.bulk_approve([f.pk for f in items], reviewer=staff_user)

    assert sorted(done) == sorted(f.pk for f in items) and skipped == []
    assert Feedback.objects.filter(status=Feedback.Status.APPROVED).count() == 3


def test_bulk_reject_skips_items_reserved_by_another(user, staff_user, staff_b):
    items = [make_feedback(user) for _ in range(2)]
    review.reserve(items[0], reviewer=staff_b)

    done, skipped = review.bulk_reject([f.pk for f in items], reviewer=staff_user, note="spam")

    assert done == [items[1].pk]
    assert [pk for pk, _ in skipped] == [items[0].pk]
    assert Feedback.objects.get(pk=items[0].pk).status == Feedback.Status.PENDING


def test_reservation_blocks_a_second_reviewer(user, staff_user, staff_b):
    feedback = make_feedback(user)
    review.reserve(feedback, reviewer=staff_user)

    with pytest.raises(review.ReservedByOther):
        review.approve(feedback, reviewer=staff_b)
    with pytest.raises(review.ReservedByOther):
        review.reserve(feedback, reviewer=staff_b)
    assert Feedback.objects.get(pk=feedback.pk).status == Feedback.Status.PENDING


def test_reservation_holder_can_act(user, staff_user):
    feedback = make_feedback(user)
    review.reserve(feedback, reviewer=staff_user)

    review.approve(feedback, reviewer=staff_user)

    feedback.refresh_from_db()
    assert feedback.status == Feedback.Status.APPROVED and feedback.reserved_by is None


def test_reservation_expires(user, staff_user, staff_b):
    feedback = make_feedback(user)
    review.reserve(feedback, reviewer=staff_user)
    Feedback.objects.filter(pk=feedback.pk).update(reserved_until=timezone.now() - timedelta(seconds=1))

    review.reject(feedback, reviewer=staff_b, note="expired reservation, mine now")

    assert Feedback.objects.get(pk=feedback.pk).reviewer == staff_b


def test_reservation_lasts_ten_minutes(user, staff_user):
    before = timezone.now()
    feedback = review.reserve(make_feedback(user), reviewer=staff_user)
    assert timedelta(minutes=9) < feedback.reserved_until - before <= timedelta(minutes=10, seconds=5)


def test_release_frees_the_item_for_others(user, staff_user, staff_b):
    feedback = make_feedback(user)
    review.reserve(feedback, reviewer=staff_user)
    review.release(feedback, reviewer=staff_user)

    review.reserve(feedback, reviewer=staff_b)

    assert Feedback.objects.get(pk=feedback.pk).reserved_by == staff_b


def test_queue_filters_by_kind_agent_user_and_status(user, other_user, staff_user):
    agent_a, agent_b = AgentFactory(), AgentFactory()
    up = make_feedback(user, agent_a, kind=Feedback.Kind.THUMB_UP)
    down = make_feedback(user, agent_b, kind=Feedback.Kind.THUMB_DOWN)
    correction = make_feedback(other_user, agent_a, kind=Feedback.Kind.CORRECTION, corrected_text="x")
    review.reject(correction, reviewer=staff_user, note="n")

    assert set(review.review_queue(kind="thumb")) == {up, down}
    assert set(review.review_queue(agent=agent_a)) == {up}
    assert set(review.review_queue(agent=agent_a, status="")) == {up, correction}
    assert set(review.review_queue(user=other_user, status="rejected")) == {correction}


def test_queue_filters_by_verdict_hold_and_date(user):
    judged = make_feedback(user, kind=Feedback.Kind.IMPLICIT, verdict="-1", hold_reason="classifier unsure")
    plain = make_feedback(user)
    Feedback.objects.filter(pk=plain.pk).update(created_at=timezone.now() - timedelta(days=3))
    today = timezone.now().date()

    assert list(review.review_queue(verdict="-1")) == [judged]
    assert list(review.review_queue(held=True)) == [judged]
    assert list(review.review_queue(held=False)) == [plain]
    assert list(review.review_queue(date_from=today)) == [judged]
    assert list(review.review_queue(date_to=today - timedelta(days=1))) == [plain]


def test_conversation_context_follows_the_branch(user):
    feedback = make_feedback(user)
    context = review.conversation_context(feedback)
    assert [t.role for t in context] == ["user", "assistant", "user", "assistant"]
    assert context[-1] == feedback.turn
