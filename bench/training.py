"""P4 benchmark: from the feedback that fills a batch to the first chat reply served by the new version.

    .venv/bin/python bench/training.py --quick          # tiny model, 3 jobs
    .venv/bin/python bench/training.py --jobs 8         # tiny model, 8 jobs
    .venv/bin/python bench/training.py --model var/models/demo-chat --jobs 5

Real processes throughout: a private test database on the machine's Postgres, Redis, the built-in
engine (`serve_model`) and one Celery worker (`-Q default,training -c 1 --pool=solo`). Each round a
user asks and corrects the reply (the agent's batch is one reply, so the correction queues a job),
and the clock runs until a reply is served by the version that job published.

Prints P4_feedback_to_live_p50_s=…, job_time_p50_s=…, worker_peak_rss_mb=… (VmHWM of the worker).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "clawplatform.settings.test")


def peak_rss_mb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 jobs on the tiny model")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--model", help="model directory (default: the tiny demo model)")
    parser.add_argument("--steps", type=int, default=8, help="agent.steps_per_job")
    args = parser.parse_args()
    jobs = 3 if args.quick else args.jobs

    import django

    django.setup()
    from asgiref.sync import async_to_sync
    from django.conf import settings
    from django.test.utils import setup_databases, teardown_databases

    from serving.engine.testing import run_engine_server

    if args.model:
        model_dir = Path(args.model).resolve()
    else:
        from serving.demo_model import DemoModelConfig, build_demo_model

        config = DemoModelConfig.tiny()
        model_dir = build_demo_model(REPO / "var" / "test-cache" / f"tiny-{config.fingerprint()}", config, progress=False)

    old_config = setup_databases(verbosity=0, interactive=False)
    adapter_root = Path(tempfile.mkdtemp(prefix="bench-training-adapters-"))
    settings.MODEL = str(model_dir)
    settings.ADAPTER_ROOT = adapter_root
    try:
        from chat import services as chat_services
        from chat.models import Agent
        from django.contrib.auth import get_user_model
        from serving.models import AdapterVersion
        from training.models import TrainingJob
        from training.tests.factories import run_worker, wait_for, worker_env

        with run_engine_server(model_dir) as engine:
            settings.INFERENCE_URLS = [engine.url]
            env = worker_env(model_dir=model_dir, inference_url=engine.url, extra={"ADAPTER_ROOT": str(adapter_root)})
            user = get_user_model().objects.create_user(username="bench-p4", password="pw-bench-123!")
            agent = Agent.objects.create(name="Bench", slug="bench", review_policy="auto_all", batch_size=1,
                                         steps_per_job=args.steps, temperature=1.0, max_tokens=16)
            p4, job_times = [], []
            with run_worker(env, name="bench") as worker:
                # The worker's first job would otherwise pay for importing torch/peft.
                wait_for(lambda: "ready" in worker.log_path.read_text(), timeout=300, what="worker ready",
                         process=worker)
                for round_ in range(jobs):
                    conversation = chat_services.create_conversation(user, agent)
                    turn = chat_services.post_user_message(conversation, "What is the capital of France?", user=user)
                    reply = async_to_sync(chat_services.acollect_reply)(turn)
                    # A batch of one reply: its correction alone queues the job.
                    started = time.monotonic()
                    chat_services.record_feedback(reply, user=user, kind="correction", corrected_text="Paris.",
                                                  comment="answer in one word")
                    number = round_ + 1
                    version = wait_for(
                        lambda: AdapterVersion.objects.filter(user=user, number=number, is_active=True).first(),
                        timeout=900, interval=0.05, what=f"version {number} live", process=worker)
                    follow = chat_services.post_user_message(conversation, "And of Spain?", user=user)
                    served = async_to_sync(chat_services.acollect_reply)(follow)
                    elapsed = time.monotonic() - started
                    assert served.adapter_name == version.name, (served.adapter_name, version.name)
                    job = wait_for(lambda: TrainingJob.objects.filter(result_version=version, state="succeeded").first(),
                                   timeout=60, what="job finished", process=worker)
                    p4.append(elapsed)
                    job_times.append(job.duration_s)
                    print(f"round {number}: feedback_to_live_s={elapsed:.2f} job_time_s={job.duration_s:.2f} "
                          f"loss={job.metrics.get('loss'):.4f} logp_a*={job.metrics.get('logp_target_before'):.3f}"
                          f"->{job.metrics.get('logp_target_after'):.3f}", flush=True)
                rss = peak_rss_mb(worker.pid)
        print(f"P4_feedback_to_live_p50_s={statistics.median(p4):.2f}")
        print(f"job_time_p50_s={statistics.median(job_times):.2f}")
        print(f"worker_peak_rss_mb={rss:.0f}")
        print(f"jobs={jobs} model={model_dir.name} steps_per_job={args.steps}")
    finally:
        teardown_databases(old_config, verbosity=0)


if __name__ == "__main__":
    main()
