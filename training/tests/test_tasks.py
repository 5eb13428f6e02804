"""Task bodies run in-process on the real DB (the worker-subprocess tests are in test_loop.py)."""
import pytest
from django.utils import timezone

from chat.tests.factories import engine, live_engine, model_settings  # noqa: F401  (fixtures)
from serving.models import AdapterVersion
from training import services, tasks
from training.config import TrainingConfig
from training.models import AuditEvent, TrainingJob, TrainingSample

from .factories import (
    AgentFactory,
    ConversationFactory,
    FeedbackFactory,
    TrainingJobFactory,
    TrainingSampleFactory,
    UserFactory,
    reply_with_context,
)


def make_ready_samples(user, agent, n, **fields):
    conversation = ConversationFactory(user=user, agent=agent)
    out = []
    for _ in range(n):
        reply = reply_with_context(conversation, **fields)
        fb = FeedbackFactory(turn=reply, author=user, kind="thumb_down", status="approved")
        from training.signals import build_samples

        out += build_samples(fb)
    return out


# Feedback processing
# ------------------------------------------------------------------------------


def test_thumb_is_auto_approved_under_default_policy(db):
    fb = FeedbackFactory(kind="thumb_up")
    assert tasks.process_feedback(fb.pk) == "approved"
    fb.refresh_from_db()
    assert fb.status == "approved" and fb.verdict == "+1"
    assert fb.samples.get().reward == 1.0


def test_correction_is_held_under_default_policy(db):
    fb = FeedbackFactory(kind="correction", corrected_text="Paris")
    assert tasks.process_feedback(fb.pk) == "held"
    fb.refresh_from_db()
    assert fb.status == "pending" and "reviewed" in fb.hold_reason and not fb.samples.exists()
    assert AuditEvent.objects.filter(action="hold_feedback", target_id=str(fb.pk)).exists()


def test_process_feedback_is_idempotent(db):
    fb = FeedbackFactory(kind="thumb_up")
    tasks.process_feedback(fb.pk)
    assert tasks.process_feedback(fb.pk) == "already processed"
    assert fb.samples.count() == 1


def test_implicit_message_is_classified_korean(db):
    agent = AgentFactory(review_policy="auto_all")
    reply = reply_with_context(ConversationFactory(agent=agent))
    fb = FeedbackFactory(turn=reply, kind="implicit", comment="아니, 짧게 해줘")
    tasks.process_feedback(fb.pk)
    fb.refresh_from_db()
    assert fb.verdict == "-1+hint" and fb.judgement.hint == "짧게 해줘"
    assert sorted(s.reward is None for s in fb.samples.all()) == [False, True]


def test_neutral_implicit_message_stays_out_of_the_queue(db):
    fb = FeedbackFactory(kind="implicit", comment="what about Germany?")
    assert tasks.process_feedback(fb.pk) == "no signal"
    fb.refresh_from_db()
    assert fb.status == "rejected" and not fb.samples.exists()


def test_withdrawn_feedback_discards_ready_samples(db, django_capture_on_commit_callbacks):
    fb = FeedbackFactory(kind="thumb_up")
    tasks.process_feedback(fb.pk)
    fb.withdrawn = True
    fb.save(update_fields=["withdrawn"])
    assert tasks.process_feedback(fb.pk) == "withdrawn"
    assert fb.samples.get().state == TrainingSample.State.DISCARDED


def test_feedback_receiver_enqueues_after_commit(db, django_capture_on_commit_callbacks, monkeypatch):
    sent = []
    monkeypatch.setattr(tasks.process_feedback, "apply_async", lambda args, queue: sent.append((args, queue)))
    with django_capture_on_commit_callbacks(execute=True):
        fb = FeedbackFactory(kind="thumb_up")
    assert sent == [([fb.pk], "default")]



def test_sweep_queues_feedback_whose_hand_off_never_happened(db, monkeypatch):
    from chat.models import Feedback
    from clawplatform.celery import app

    fb = FeedbackFactory(kind="thumb_up")  # inside the test transaction: the on-commit hand-off never runs
    Feedback.objects.filter(pk=fb.pk).update(created_at=timezone.now() - timezone.timedelta(minutes=2))
    fresh = FeedbackFactory(kind="thumb_up")
    monkeypatch.setitem(app.conf, "task_always_eager", True)
    assert tasks.requeue_unprocessed_feedback() == 1
    fb.refresh_from_db()
    fresh.refresh_from_db()
    assert fb.status == "approved" and fb.samples.count() == 1
    assert fresh.status == "pending"  # too young: its own hand-off may still be on the way
    assert tasks.requeue_unprocessed_feedback() == 0

# Jobs
# ------------------------------------------------------------------------------


def test_one_open_job_per_user_agent(db):
    user, agent = UserFactory(), AgentFactory()
    make_ready_samples(user, agent, 2)
    assert services.request_training(user, agent, trigger="manual") is not None
    assert services.request_training(user, agent, trigger="manual") is None
    assert TrainingJob.objects.filter(user=user, agent=agent).count() == 1


def test_thumbs_alone_never_queue_an_opd_job(db):
    user, agent = UserFactory(), AgentFactory(batch_size=2, training_method="opd")
    make_ready_samples(user, agent, 3)  # thumbs down: rewards, no corrections
    assert services.maybe_request_training(user, agent) is None
    assert services.request_training(user, agent, trigger="manual") is None
    agent.training_method = "binary"
    assert services.maybe_request_training(user, agent) is not None


def test_batch_size_triggers_a_job(db):
    user, agent = UserFactory(), AgentFactory(batch_size=3)
    make_ready_samples(user, agent, 2)
    assert services.maybe_request_training(user, agent) is None
    make_ready_samples(user, agent, 1)
    assert services.maybe_request_training(user, agent).trigger == "auto"


def thumb_down_and_correct(user, reply, text="Paris. Cheers!"):
    """The samples of a thumb down and a correction on one reply."""
    from training.signals import build_samples

    samples = []
    for kind, fields in (("thumb_down", {}), ("correction", {"corrected_text": text})):
        samples += build_samples(FeedbackFactory(turn=reply, author=user, kind=kind, status="approved", **fields))
    return samples


def test_a_batch_counts_replies_not_the_samples_of_one_reply(db):
    user, agent = UserFactory(), AgentFactory(batch_size=2)
    thumb_down_and_correct(user, reply_with_context(ConversationFactory(user=user, agent=agent)))
    assert services.usable_samples(user, agent).count() == 3  # one reply, three samples
    assert services.maybe_request_training(user, agent) is None
    thumb_down_and_correct(user, reply_with_context(ConversationFactory(user=user, agent=agent)))
    assert services.maybe_request_training(user, agent).trigger == "auto"


def test_corrections_and_rewards_fill_separate_batches(db):
    user, agent = UserFactory(), AgentFactory(batch_size=2)
    thumb_down_and_correct(user, reply_with_context(ConversationFactory(user=user, agent=agent)))
    make_ready_samples(user, agent, 1)  # one corrected reply and one thumbed: neither batch is full
    assert services.maybe_request_training(user, agent) is None
    make_ready_samples(user, agent, 1)  # a second thumbed reply fills the rewards' batch
    job = services.maybe_request_training(user, agent)
    assert job.trigger == "auto"


def test_paused_training_queues_nothing(db, staff_user):
    user, agent = UserFactory(), AgentFactory()
    make_ready_samples(user, agent, 1)
    services.pause_training(user=user, actor=staff_user, reason="abuse report")
    assert services.is_training_paused(user, agent)
    assert services.request_training(user, agent, trigger="manual") is None
    services.resume_training(user=user, actor=staff_user)
    assert not services.is_training_paused(user, agent)


def test_fair_scheduling_serves_users_round_robin(db):
    heavy, light = UserFactory(), UserFactory()
    jobs = [TrainingJob.objects.create(user=heavy, agent=AgentFactory(), method="binary") for _ in range(3)]
    jobs.append(TrainingJob.objects.create(user=light, agent=AgentFactory(), method="binary"))
    order = []
    for job in jobs:  # each queued job's message claims the fairest queued job
        claimed = tasks.claim_job(job.pk)
        order.append(claimed.user_id)
        claimed.state = TrainingJob.State.SUCCEEDED
        claimed.finished_at = timezone.now()
        claimed.save()
    # FIFO would be heavy, heavy, heavy, light.
    assert order == [heavy.pk, light.pk, heavy.pk, heavy.pk]


def test_cancel_queued_job(db, staff_user):
    user, agent = UserFactory(), AgentFactory()
    make_ready_samples(user, agent, 1)
    job = services.request_training(user, agent, trigger="manual")
    services.cancel_job(job, actor=user)
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert tasks.claim_job(job.pk) is None  # its message finds nothing to run


@pytest.fixture
def tiny_job(db, model_settings):
    user, agent = UserFactory(), AgentFactory(steps_per_job=2, learning_rate=1e-3, training_method="binary")
    from training.trainer import load_policy, template_ids
    import torch

    tokenizer, _ = load_policy(model_settings.MODEL, None, TrainingConfig(), torch.device("cpu"))
    prompt = template_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    make_ready_samples(user, agent, 2, prompt_token_ids=prompt, token_ids=[40, 41, 42],
                       logprobs=[-2.0, -2.5, -3.0])
    job = services.request_training(user, agent, trigger="manual")
    return tasks.claim_job(job.pk)


def test_nan_loss_fails_job_and_publishes_nothing(tiny_job):
    TrainingSample.objects.filter(job__isnull=True).update(reward=float("nan"))
    job = tasks.execute_job(tiny_job)
    assert job.state == "failed" and "non-finite" in job.error
    assert not AdapterVersion.objects.exists()
    assert set(TrainingSample.objects.values_list("state", flat=True)) == {"ready"}
    assert not tasks.staging_dir(job.pk).exists()


def test_cancel_running_job_publishes_nothing(tiny_job):
    services.cancel_job(tiny_job, actor=tiny_job.user)
    job = tasks.execute_job(TrainingJob.objects.get(pk=tiny_job.pk))
    assert job.state == "cancelled" and not AdapterVersion.objects.exists()
    assert set(TrainingSample.objects.values_list("state", flat=True)) == {"ready"}


def test_job_publishes_activates_once_and_audits(tiny_job, live_engine):
    job = tasks.execute_job(tiny_job)
    assert job.state == "succeeded", job.error
    version = AdapterVersion.objects.get()
    assert version.is_active and job.result_version == version
    assert version.config["method"] == "binary" and "loss" in version.metrics
    assert set(TrainingSample.objects.values_list("state", flat=True)) == {"used"}
    assert AuditEvent.objects.filter(action="activate", target_id=str(version.pk)).exists()
    # A redelivered message after a crash finds the job published: no second version.
    TrainingJob.objects.filter(pk=job.pk).update(state="running")
    tasks.execute_job(TrainingJob.objects.get(pk=job.pk))
    assert AdapterVersion.objects.count() == 1


def add_corrections(user, agent, texts):
    from training.signals import build_samples

    conversation = ConversationFactory(user=user, agent=agent)
    for text in texts:
        reply = reply_with_context(conversation)
        build_samples(FeedbackFactory(turn=reply, author=user, kind="correction", corrected_text=text,
                                      status="approved"))


def run_next_job(user, agent):
    job = services.request_training(user, agent, trigger="manual")
    job = tasks.execute_job(tasks.claim_job(job.pk))
    assert job.state == "succeeded", job.error
    return job


def test_opd_jobs_replay_the_corrections_their_version_learned_not_abandoned_ones(db, model_settings, live_engine):
    user, agent = UserFactory(), AgentFactory(steps_per_job=1, training_method="opd")
    add_corrections(user, agent, ["Paris. Cheers!", "Rome. Cheers!"])
    first = run_next_job(user, agent)
    assert first.metrics["samples_replayed"] == 0 and first.metrics["directive_samples"] == 2

    add_corrections(user, agent, ["Oslo. Cheers!"])
    second = run_next_job(user, agent)
    # Both earlier corrections train again beside the new one.
    assert second.metrics["samples_replayed"] == 2 and second.metrics["directive_samples"] == 3

    # Back to the first version: the second job's correction belongs to an abandoned branch.
    services.activate(first.result_version, user=user, agent=agent, actor=user)
    add_corrections(user, agent, ["Bern. Cheers!"])
    third = run_next_job(user, agent)
    assert third.parent_version == first.result_version
    assert third.metrics["samples_replayed"] == 2 and third.metrics["directive_samples"] == 3
    replayed_texts = set(TrainingSample.objects.filter(job=first).values_list("target_text", flat=True))
    assert replayed_texts == {"Paris. Cheers!", "Rome. Cheers!"}

    # Reset to base: nothing to build on, nothing replayed.
    services.activate(None, user=user, agent=agent, actor=user)
    add_corrections(user, agent, ["Lima. Cheers!"])
    assert run_next_job(user, agent).metrics["samples_replayed"] == 0


def test_a_job_replays_only_the_newest_corrections_up_to_the_default_limit(db):
    user, agent = UserFactory(), AgentFactory()
    version = AdapterVersion.objects.create(
        user=user, agent_id=agent.pk, number=1, name=f"u{user.pk}-a{agent.pk}-v1", path="x", sha256="0" * 64,
        base_model_name="base", base_model_hash="0" * 64,
    )
    earlier = TrainingJobFactory(user=user, agent=agent, state="succeeded", result_version=version)
    limit = TrainingConfig().replay_corrections
    conversation = ConversationFactory(user=user, agent=agent)
    texts = [f"Answer {i}. Cheers!" for i in range(limit + 5)]
    for text in texts:
        feedback = FeedbackFactory(turn=reply_with_context(conversation), author=user, kind="correction",
                                   corrected_text=text, status="approved")
        TrainingSampleFactory(feedback=feedback, target_text=text, reward=None, job=earlier, state="used")

    job = TrainingJobFactory(user=user, agent=agent, parent_version=version)
    replayed = services.corrections_to_replay(job, limit)
    assert [s.target_text for s in replayed] == texts[::-1][:limit]


def test_every_minus_one_on_a_corrected_reply_knows_the_correction(db):
    """The thumb-down and the correction of one reply both blame only what the correction changed,
    and the correction's OPD target knows the reply it corrected, with the sampler's logprobs."""
    from training.signals import build_samples
    from training.trainer import examples_from_samples

    user, agent = UserFactory(), AgentFactory()
    reply = reply_with_context(ConversationFactory(user=user, agent=agent), prompt_token_ids=[1, 2, 3],
                               token_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3])
    samples = thumb_down_and_correct(user, reply)
    other = reply_with_context(ConversationFactory(user=user, agent=agent), prompt_token_ids=[1, 2],
                               token_ids=[5, 6], logprobs=[-0.1, -0.2])
    samples += build_samples(FeedbackFactory(turn=other, author=user, kind="thumb_down", status="approved"))

    examples, skipped = examples_from_samples(TrainingSample.objects.filter(pk__in=[s.pk for s in samples])
                                              .select_related("turn__adapter_version"))
    assert skipped == []
    on_reply = [e for e in examples if e.kind == "eval" and e.response_ids == [7, 8, 9]]
    assert len(on_reply) == 2 and {e.corrected_text for e in on_reply} == {"Paris. Cheers!"}
    [on_other] = [e for e in examples if e.kind == "eval" and e.response_ids == [5, 6]]
    assert on_other.corrected_text == ""
    assert {e.turn_id for e in on_reply} == {reply.pk} and on_other.turn_id == other.pk  # the baseline counts replies
    [directive] = [e for e in examples if e.kind == "directive"]
    assert directive.target_text == "Paris. Cheers!" and directive.original_ids == [7, 8, 9]
    assert directive.original_logprobs == [-0.1, -0.2, -0.3]
