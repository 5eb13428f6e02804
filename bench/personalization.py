"""Personalization benchmark: does the platform learn each user's preference, how fast, and at what cost?

Simulated users talk to the real platform through its public interfaces: replies come from
`POST /v1/chat/completions` (API key, served by the built-in engine with the user's active
adapter), feedback goes to `POST /api/turns/<id>/feedback` (the browser's endpoint), training runs
as real Celery jobs in a worker subprocess, and each new version goes live through hot-load.
Nothing here calls the trainer.

Run:
    python manage.py bench_personalization [--quick] [--preferences FILE]
    python bench/personalization.py --quick

Prints one `NAME=value` line per figure and writes docs/benchmarks/personalization/
(results.json, results.md, adherence.png).
"""
import argparse
import json
import os
import sys
import time
import uuid
import zlib
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.testing import run_worker, wait_for  # noqa: E402  (no Django needed)

METHODS = ("none", "binary", "opd", "combined", "offline")
AGENT_SETTINGS = ("learning_rate", "steps_per_job", "batch_size", "lora_rank", "alpha", "kl_coef",
                  "distill_kept_tokens", "distill_min_base_prob", "kl_base_min_prob")
TRAINED_ONLINE = ("binary", "opd", "combined")
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass
class BenchConfig:
    preferences: Path = field(default=REPO / "bench" / "preferences.json", metadata={"help": "Preference JSON file."})
    only: tuple = field(default=(), metadata={"help": "Names of the preferences to run (empty: all)."})
    methods: tuple = METHODS
    checkpoints: tuple = (0, 2, 4, 8, 16)  # update steps (published jobs) at which adherence is measured
    eval_prompts: int = 24  # held-out prompts for adherence, per checkpoint
    retention_questions: int = 40  # held-out questions for skill retention
    leakage_prompts: int = 8  # bystander prompts that must stay bit-identical
    # Agent settings that differ from the Agent model's defaults (learning_rate, steps_per_job,
    # batch_size, lora_rank, alpha, kl_coef, distill_kept_tokens, distill_min_base_prob,
    # kl_base_min_prob): empty measures the defaults.
    agent: dict = field(default_factory=dict)
    temperature: float = 0.7  # sampling temperature of interaction replies
    max_tokens: int = 48
    seed: int = 0
    model: str = ""  # empty: settings.MODEL
    device: str = "cpu"
    out: Path = REPO / "docs" / "benchmarks" / "personalization"
    job_timeout_s: float = 900.0
    max_failed_jobs: int = 3  # failed jobs in a row after which an arm is reported as stalled
    max_interactions_per_step: int = 40  # without a published step by then, the arm is stalled

    @classmethod
    def quick(cls, **overrides):
        # One unseen preference: two users took 12.5 minutes on the 2 cores with the base-model
        # gates of the current defaults (docs/benchmarks.md).
        base = dict(only=("signoff_zorblat",), checkpoints=(0, 2, 4),
                    eval_prompts=12, retention_questions=16, leakage_prompts=4)
        return cls(**{**base, **overrides})

    @property
    def max_steps(self):
        return max(self.checkpoints)


# Processes: engine and worker
# ------------------------------------------------------------------------------


def database_url():
    from django.db import connection

    db = connection.settings_dict
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgres://{db['USER']}{password}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@contextmanager
def platform_processes(config, model_dir, adapter_root):
    """Start the engine and a Celery worker that share this process's database and Redis prefix."""
    from django.conf import settings

    from serving.engine.testing import run_engine_server

    # The worker shares this process's Redis prefix, hence its queues (execute() gives a
    # standalone run a fresh one, so that a deployment's own worker never takes these jobs).
    prefix = settings.REDIS_KEY_PREFIX
    settings_env = {
        "DJANGO_SETTINGS_MODULE": "clawplatform.settings.local",
        "DEBUG": "false",
        "DATABASE_URL": database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "REDIS_KEY_PREFIX": prefix,
        "MODEL": str(model_dir),
        "ADAPTER_ROOT": str(adapter_root),
        "TRAIN_DEVICE": config.device,
        # Simulated users give feedback far faster than people: no flood hold for them.
        "TRAINING_HOLD_FEEDBACK_PER_HOUR": str(10**6),
        "PYTHONUNBUFFERED": "1",
    }
    # Restored on exit: inside the test suite these are the process's real settings.
    overrides = {"ADAPTER_ROOT": adapter_root, "MODEL": str(model_dir),
                 # Simulated users talk much faster than people: lift the per-user rate limits.
                 "RATE_LIMIT_MESSAGES_PER_MINUTE": 10**6, "RATE_LIMIT_FEEDBACK_PER_MINUTE": 10**6}
    saved = {name: getattr(settings, name) for name in (*overrides, "INFERENCE_URLS")}
    for name, value in overrides.items():
        setattr(settings, name, value)
    try:
        with ExitStack() as stack:
            engine = stack.enter_context(run_engine_server(
                model_dir, env={**settings_env, "DJANGO_SETTINGS_MODULE": "clawplatform.settings.local"},
                extra_args=("--device", config.device)))
            settings.INFERENCE_URLS = [engine.url]
            worker = stack.enter_context(run_worker({**os.environ, **settings_env, "INFERENCE_URL": engine.url},
                                                    name=f"bench-{uuid.uuid4().hex[:6]}"))
            yield engine, worker
    finally:
        for name, value in saved.items():
            setattr(settings, name, value)


# The simulated user, through the public HTTP interfaces
# ------------------------------------------------------------------------------


class SimulatedUser:
    """One person with a hidden preference, an API key, and a browser session."""

    def __init__(self, name, agent_settings, preference=None):
        from django.contrib.auth import get_user_model
        from django.test import Client

        from chat.models import Agent, ApiKey

        user_model = get_user_model()
        self.user = user_model.objects.create_user(username=name, password=uuid.uuid4().hex)
        self.agent = Agent.objects.create(owner=self.user, name=name, slug=name, system_prompt=SYSTEM_PROMPT,
                                          review_policy=Agent.ReviewPolicy.AUTO_ALL, **agent_settings)
        _, self.api_key = ApiKey.objects.create_key(self.user, "bench")
        self.preference = preference
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.api_key}", SERVER_NAME="localhost")
        self.browser = Client(SERVER_NAME="localhost", enforce_csrf_checks=False)
        self.browser.force_login(self.user)
        self.sessions = 0
        self.sampled_requests = 0

    def request_body(self, messages, *, greedy):
        """The completion request: greedy, or sampled with a seed that counts the sampled requests
        alone, so a rerun replays the same conversation and measurements between turns never shift it."""
        if greedy:
            return {"model": self.agent.slug, "messages": messages, "temperature": 0.0, "seed": 0}
        self.sampled_requests += 1
        return {"model": self.agent.slug, "messages": messages, "seed": self.sampled_requests}

    def complete(self, messages, *, session, greedy, side=False, max_tokens=None, done=False):
        body = self.request_body(messages, greedy=greedy)
        if max_tokens:
            body["max_tokens"] = max_tokens
        headers = {"HTTP_X_SESSION_ID": session, "HTTP_X_TURN_TYPE": "side" if side else "main"}
        if done:
            headers["HTTP_X_SESSION_DONE"] = "1"
        response = self.api.post("/v1/chat/completions", json.dumps(body), content_type="application/json",
                                 **headers)
        if response.status_code != 200:
            raise RuntimeError(f"/v1/chat/completions answered {response.status_code}: {response.content[:300]}")
        data = response.json()
        return data["choices"][0]["message"]["content"], int(response["X-Turn-Id"])

    def feedback(self, turn_id, **payload):
        response = self.browser.post(f"/api/turns/{turn_id}/feedback", json.dumps(payload),
                                     content_type="application/json")
        if response.status_code != 201:
            raise RuntimeError(f"feedback answered {response.status_code}: {response.content[:300]}")

    def ask_greedy(self, question):
        self.sessions += 1
        text, _ = self.complete([{"role": "user", "content": question}], session=f"eval-{self.sessions}",
                                greedy=True, side=True, done=True)
        return text


def react(user, reply, turn_id, *, method):
    """The user's explicit feedback; returns the opening of their next message (the implicit signal)."""
    if user.preference.check(reply):
        user.feedback(turn_id, kind="thumb_up")
        return "Thanks! "
    user.feedback(turn_id, kind="thumb_down", reason="Wrong style")
    fixed = user.preference.transform(reply)
    # The user just fixes the reply, with no note: c' is c, and OPD learns a* where it is asked.
    # An empty reply leaves nothing to fix (the API refuses an empty correction): the thumb only.
    if method != "binary" and fixed.strip():
        user.feedback(turn_id, kind="correction", corrected_text=fixed)
    return "No, that's not how I like it. "


def interact(user, questions, *, method):
    """One two-message session: ask, react, ask again (the next-state signal), react."""
    user.sessions += 1
    session = f"train-{user.sessions}"
    messages = [{"role": "user", "content": next(questions)}]
    reply, turn_id = user.complete(messages, session=session, greedy=False)
    opening = react(user, reply, turn_id, method=method)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": opening + next(questions)}]
    reply, turn_id = user.complete(messages, session=session, greedy=False, done=True)
    react(user, reply, turn_id, method=method)
    return 2


def feedback_processed(user):
    from chat.models import Feedback

    return not Feedback.objects.filter(author=user.user, verdict="", status=Feedback.Status.PENDING).exists()


def finished_jobs(user):
    from training.models import TrainingJob

    return TrainingJob.objects.filter(user=user.user, state__in=["succeeded", "failed", "cancelled"])


def run_until_step(user, questions, *, method, target_steps, worker, config, log):
    """Interact until `target_steps` jobs have published; returns (interactions spent, stalled).

    A job that fails (a guard refused it) publishes nothing; after `max_failed_jobs` failures in
    a row, or `max_interactions_per_step` interactions without a published step (a method that
    finds nothing to learn from: OPD when nearly every reply already passes), the arm is stalled:
    it stays at its last published version for the remaining steps.
    """
    from training.models import TrainingJob

    interactions, failures_in_a_row, since_step = 0, 0, 0
    published = finished_jobs(user).filter(state="succeeded").count()
    while published < target_steps:
        if failures_in_a_row >= config.max_failed_jobs or since_step >= config.max_interactions_per_step:
            return interactions, True
        spent = interact(user, questions, method=method)
        interactions += spent
        since_step += spent
        wait_for(lambda: feedback_processed(user), timeout=config.job_timeout_s, what="feedback processing",
                 process=worker)  # the one worker may be busy with a training job first
        job = TrainingJob.objects.filter(user=user.user, state__in=TrainingJob.OPEN_STATES).first()
        if job is not None:
            wait_for(lambda: not TrainingJob.objects.filter(pk=job.pk, state__in=TrainingJob.OPEN_STATES).exists(),
                       timeout=config.job_timeout_s, what=f"job {job.pk}", process=worker)
            job.refresh_from_db()
            failures_in_a_row = 0 if job.state == "succeeded" else failures_in_a_row + 1
            if job.state != "succeeded":
                log(f"  job {job.pk} {job.state}: {job.error}")
        # Count in the database: a finished job may already have queued the next one.
        now_published = finished_jobs(user).filter(state="succeeded").count()
        if now_published > published:
            published, since_step = now_published, 0
    return interactions, False


def train_offline(user, worker, config):
    """'Offline': one OPD-only job on all logged corrections, started from the panel's "train now"."""
    user.agent.training_enabled = True
    user.agent.training_method = "offline"
    user.agent.save(update_fields=["training_enabled", "training_method"])
    response = user.browser.post(f"/training/agents/{user.agent.pk}/train/")
    if response.status_code not in (200, 302):
        raise RuntimeError(f"train now answered {response.status_code}")
    from training.models import TrainingJob

    if not TrainingJob.objects.filter(user=user.user, agent=user.agent).exists():
        return  # no correction was logged: nothing to train on, no job was queued
    wait_for(lambda: finished_jobs(user).exists(), timeout=config.job_timeout_s, what="offline job", process=worker)


# Measurements
# ------------------------------------------------------------------------------


def adherence(user, prompts):
    replies = [user.ask_greedy(prompt) for prompt in prompts]
    return sum(user.preference.check(reply) for reply in replies) / len(replies), replies


def retention(user, questions):
    """Accuracy on the model's own held-out questions, and a few of the replies it got wrong."""
    from serving.demo_model.corpus import is_correct

    replies = [(qa, user.ask_greedy(qa.question)) for qa in questions]
    wrong = [reply for qa, reply in replies if not is_correct(qa, reply)]
    return 1 - len(wrong) / len(questions), wrong[:3]


@dataclass
class ArmResult:
    method: str
    preference: str
    adherence: dict = field(default_factory=dict)  # step -> fraction
    interactions: dict = field(default_factory=dict)  # step -> interactions so far
    wall_s: dict = field(default_factory=dict)  # step -> seconds so far
    retention: float | None = None  # accuracy after the last step
    retention_at: dict = field(default_factory=dict)  # step -> accuracy (trained steps only)
    jobs_failed: int = 0
    job_errors: list = field(default_factory=list)  # "job N failed: <the guard's reason>" per failed job
    stalled_at: int | None = None  # published steps when guards refused every further job
    misses: dict = field(default_factory=dict)  # step -> a few held-out replies that failed the check
    retention_misses: dict = field(default_factory=dict)  # step -> a few wrong answers to the questions


def run_arm(method, preference, config, *, prompts, worker, log):
    """One simulated user with one preference under one method."""
    from serving.demo_model.corpus import question_stream

    name = f"{method}-{preference.name}".replace("_", "-")[:60]
    settings = dict(config.agent, training_method="combined" if method in ("none", "offline") else method,
                    training_enabled=method in TRAINED_ONLINE, temperature=config.temperature,
                    max_tokens=config.max_tokens)
    user = SimulatedUser(name, settings, preference)
    # The user asks about everything the model knows, in the mix the held-out prompts have.
    seed = zlib.crc32(f"{config.seed}-{preference.name}".encode())
    questions = (qa.question for qa in question_stream(seed))
    result = ArmResult(method, preference.name)
    start, interactions = time.monotonic(), 0
    for step in config.checkpoints:
        if method in TRAINED_ONLINE and result.stalled_at is None:
            spent, stalled = run_until_step(user, questions, method=method, target_steps=step, worker=worker,
                                            config=config, log=log)
            interactions += spent
            if stalled:
                result.stalled_at = finished_jobs(user).filter(state="succeeded").count()
                log(f"  {method} {preference.name}: stalled at {result.stalled_at} published steps")
        elif method == "offline" and step:
            # Logs the same kind of traffic as the online arms, trains once at the end.
            while interactions < result_interactions_hint(config, step):
                interactions += interact(user, questions, method=method)
            wait_for(lambda: feedback_processed(user), timeout=config.job_timeout_s, what="feedback processing",
                 process=worker)  # the one worker may be busy with a training job first
            if step == config.max_steps:
                train_offline(user, worker, config)
        if method in TRAINED_ONLINE or step in (0, config.max_steps) or method == "none":
            result.adherence[step], replies = adherence(user, prompts["adherence"])
            result.misses[step] = [r for r in replies if not preference.check(r)][:3]
        if step and method != "none" and step in result.adherence:
            result.retention_at[step], result.retention_misses[step] = retention(user, prompts["retention"])
        result.interactions[step] = interactions
        result.wall_s[step] = round(time.monotonic() - start, 1)
        log(f"  {method:9s} {preference.name:18s} step {step:2d}: adherence {result.adherence.get(step)} "
            f"after {interactions} interactions, {result.wall_s[step]} s")
    if result.retention_at:
        result.retention = result.retention_at[config.max_steps]
    unpublished = finished_jobs(user).exclude(state="succeeded").order_by("pk")
    result.job_errors = [f"job {job.pk} {job.state}: {job.error}" for job in unpublished]
    result.jobs_failed = len(result.job_errors)
    return result


def result_interactions_hint(config, step):
    # Offline logs about as many interactions as an online arm spends per step (2-3 per job).
    return step * max(2, agent_setting(config, "batch_size") // 2)


def agent_setting(config, name):
    """The value of an agent setting the arms train with: the override, else the model's default."""
    from chat.models import Agent

    return config.agent.get(name, Agent._meta.get_field(name).default)


def bystander_replies(bystander, prompts):
    return [bystander.ask_greedy(p) for p in prompts]


# Report
# ------------------------------------------------------------------------------


def summarize(results, base_retention, leakage, config):
    figures = {}
    for method in config.methods:
        arms = [r for r in results if r.method == method]
        if not arms:
            continue
        for step in config.checkpoints:
            values = [r.adherence[step] for r in arms if step in r.adherence]
            if values:
                figures[f"{method}_adherence_step{step}"] = round(sum(values) / len(values), 3)
        if method == "offline":
            figures["offline_adherence_final"] = figures.get(f"offline_adherence_step{config.max_steps}")
        retentions = [r.retention for r in arms if r.retention is not None]
        if retentions and base_retention:
            figures[f"{method}_retention"] = round(sum(retentions) / len(retentions) / base_retention, 3)
        for step in config.checkpoints[1:]:
            values = [r.retention_at[step] for r in arms if step in r.retention_at]
            if values and base_retention:
                figures[f"{method}_retention_step{step}"] = round(sum(values) / len(values) / base_retention, 3)
        figures[f"{method}_wall_s"] = round(sum(r.wall_s[config.max_steps] for r in arms), 1)
    figures["base_accuracy"] = round(base_retention, 3)
    figures["leakage"] = leakage
    return figures


def write_report(results, figures, config, out):
    out.mkdir(parents=True, exist_ok=True)
    config_data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    config_data["agent"] = {name: agent_setting(config, name) for name in AGENT_SETTINGS}
    raw = {"config": config_data, "figures": figures, "arms": [asdict(r) for r in results]}
    (out / "results.json").write_text(json.dumps(raw, indent=2, default=str))
    steps = config.checkpoints
    trained = steps[1:]
    lines = ["| method | " + " | ".join(f"adherence @{s}" for s in steps) + " | "
             + " | ".join(f"retention @{s}" for s in trained) + " | leakage |",
             "|---" * (len(steps) + len(trained) + 2) + "|"]
    for method in config.methods:
        cells = [str(figures.get(f"{method}_adherence_step{s}", "–")) for s in steps]
        cells += [str(figures.get(f"{method}_retention_step{s}", "–")) for s in trained]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {figures['leakage']} |")
    per_pref = ["", "| method | preference | " + " | ".join(f"@{s}" for s in steps)
                + " | interactions | accuracy | failed jobs | stalled at |",
                "|---" * (len(steps) + 6) + "|"]
    def cell(value):
        return "–" if value is None else f"{value:.3f}"

    for r in results:
        per_pref.append(f"| {r.method} | {r.preference} | " + " | ".join(cell(r.adherence.get(s)) for s in steps)
                        + f" | {r.interactions.get(config.max_steps)} | {cell(r.retention)} | {r.jobs_failed} | "
                        + ("–" if r.stalled_at is None else f"{r.stalled_at} steps") + " |")
    failed = [f"- {r.method} {r.preference}: {error}" for r in results for error in r.job_errors]
    if failed:
        per_pref += ["", "Jobs that published nothing (the previous version stayed active):", "", *failed]
    (out / "results.md").write_text("\n".join(lines + per_pref) + "\n")
    plot(results, config, out / "adherence.png")


def plot(results, config, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in config.methods:
        arms = [r for r in results if r.method == method]
        steps = [s for s in config.checkpoints if all(s in r.adherence for r in arms)]
        if arms and steps:
            ax.plot(steps, [sum(r.adherence[s] for r in arms) / len(arms) for s in steps], marker="o", label=method)
    ax.set_xlabel("update steps (published jobs)")
    ax.set_ylabel("held-out adherence")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Entry point
# ------------------------------------------------------------------------------


def heldout_prompts(config):
    """The held-out prompts for adherence, the questions for retention, the bystander's prompts."""
    from serving.demo_model.corpus import heldout_questions

    heldout = heldout_questions(n=config.eval_prompts + config.retention_questions + config.leakage_prompts,
                                seed=1234 + config.seed)
    return {"adherence": [qa.question for qa in heldout[: config.eval_prompts]],
            "retention": heldout[config.eval_prompts: config.eval_prompts + config.retention_questions],
            "leakage": [qa.question for qa in heldout[-config.leakage_prompts:]]}


def run(config, *, log=print):
    """Run the benchmark in the current database. Returns (figures, results)."""
    import tempfile

    from django.conf import settings

    from bench.preferences import load_preferences

    preferences = [p for p in load_preferences(config.preferences) if not config.only or p.name in config.only]
    model_dir = Path(config.model or settings.MODEL)
    prompts = heldout_prompts(config)
    with tempfile.TemporaryDirectory(prefix="claw-bench-") as tmp, \
            platform_processes(config, model_dir, Path(tmp) / "adapters") as (_, worker):
        bystander = SimulatedUser("bystander", {"training_enabled": False})
        before = bystander_replies(bystander, prompts["leakage"])
        base_retention, _ = retention(bystander, prompts["retention"])
        log(f"base accuracy on {len(prompts['retention'])} held-out questions: {base_retention:.3f}")
        results = []
        for preference in preferences:
            for method in config.methods:
                results.append(run_arm(method, preference, config, prompts=prompts, worker=worker, log=log))
        after = bystander_replies(bystander, prompts["leakage"])
        leakage = sum(a != b for a, b in zip(before, after))
    figures = summarize(results, base_retention, leakage, config)
    return figures, results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    options = vars(parser.parse_args(argv))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "clawplatform.settings.local")
    import django

    django.setup()
    execute(options)


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="1 unseen preference (the sign-off), steps 0/2/4: under 10 minutes.")
    parser.add_argument("--preferences", type=Path, default=REPO / "bench" / "preferences.json")
    parser.add_argument("--only", default="", help="Comma-separated preference names.")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--checkpoints", default="", help="Comma-separated update steps, e.g. 0,2,4,8,16.")
    parser.add_argument("--model", default="", help="Model directory (default: settings.MODEL).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "personalization")
    parser.add_argument("--keep-db", action="store_true", help="Keep the benchmark's database afterwards.")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Override a BenchConfig field or an agent setting (JSON value), e.g. "
                             "--set learning_rate=5e-3 --set distill_kept_tokens=true.")


def use_private_queues():
    """Give this run its own Redis prefix before anything connects, so its Celery jobs never
    reach a worker of a running deployment (and its worker takes nobody else's)."""
    from django.conf import settings

    from clawplatform.celery import app as celery_app

    settings.REDIS_KEY_PREFIX = prefix = f"claw-bench-{uuid.uuid4().hex[:8]}"
    celery_app.conf.broker_transport_options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS,
                                                "global_keyprefix": f"{prefix}:celery:"}


def execute(options):
    """Run in a fresh database of its own (like a test database) so no real data is touched."""
    from django.db import connection

    overrides = dict(preferences=options["preferences"], methods=tuple(options["methods"].split(",")),
                     model=options["model"], device=options["device"], out=options["out"])
    if options["only"]:
        overrides["only"] = tuple(options["only"].split(","))
    if options["checkpoints"]:
        overrides["checkpoints"] = tuple(int(s) for s in options["checkpoints"].split(","))
    for item in options["set"]:
        name, _, value = item.partition("=")
        if name in AGENT_SETTINGS:
            overrides.setdefault("agent", {})[name] = json.loads(value)
        else:
            overrides[name] = type(BenchConfig.__dataclass_fields__[name].default)(value)
    config = BenchConfig.quick(**overrides) if options["quick"] else BenchConfig(**overrides)
    use_private_queues()
    original_name = connection.settings_dict["NAME"]
    connection.settings_dict.setdefault("TEST", {})["NAME"] = f"claw_bench_{uuid.uuid4().hex[:8]}"
    connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        started = time.monotonic()
        figures, results = run(config)
        figures["total_wall_s"] = round(time.monotonic() - started, 1)
        write_report(results, figures, config, config.out)
        for name, value in figures.items():
            print(f"{name}={value}")
    finally:
        if not options["keep_db"]:
            connection.creation.destroy_test_db(original_name, verbosity=0)


if __name__ == "__main__":
    main()
