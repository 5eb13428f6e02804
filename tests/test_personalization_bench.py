"""The personalization benchmark's small version: 2 preferences, 2 update steps, the tiny model.

It goes through the real platform (/v1, the feedback API, a Celery worker subprocess, the engine
subprocess with hot-load), exactly as `python manage.py bench_personalization` does.
"""
import json

import pytest

from bench.personalization import BenchConfig, run, summarize, write_report

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(1200)]

PREFERENCES = {"preferences": [
    {"name": "answer_prefix", "rule": {"type": "startswith", "phrase": "Answer:"}},
    {"name": "signoff_zorblat", "unseen": True, "rule": {"type": "endswith", "phrase": "Cheers, Zorblat!"}},
]}


@pytest.fixture
def bench_run(tiny_model_dir, tmp_path, settings):
    path = tmp_path / "prefs.json"
    path.write_text(json.dumps(PREFERENCES))
    config = BenchConfig(preferences=path, methods=("none", "combined"), checkpoints=(0, 2), eval_prompts=8,
                         retention_questions=4, leakage_prompts=3, agent={"learning_rate": 5e-3},
                         max_tokens=24, model=str(tiny_model_dir), out=tmp_path / "out")
    figures, results = run(config, log=lambda *a: None)
    return config, figures, results


def test_combined_adherence_rises_and_nothing_leaks(bench_run):
    config, figures, results = bench_run
    assert figures["combined_adherence_step2"] > figures["combined_adherence_step0"]
    assert figures["none_adherence_step2"] == figures["none_adherence_step0"]
    assert figures["leakage"] == 0
    assert all(r.jobs_failed == 0 and r.job_errors == [] for r in results), [r.job_errors for r in results]
    assert all(r.interactions[2] > 0 for r in results if r.method == "combined")
    # Accuracy is measured after every trained checkpoint, the last one is the arm's retention.
    assert all(set(r.retention_at) == {2} and r.retention == r.retention_at[2] for r in results
               if r.method == "combined")
    assert all(r.retention_at == {} and r.retention is None for r in results if r.method == "none")

    write_report(results, figures, config, config.out)
    table = (config.out / "results.md").read_text()
    assert table.startswith("| method |") and "| combined |" in table and "retention @2" in table
    assert json.loads((config.out / "results.json").read_text())["figures"] == figures
    assert (config.out / "adherence.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_averages_arms_and_scales_retention_by_base():
    from bench.personalization import ArmResult

    config = BenchConfig(methods=("combined",), checkpoints=(0, 2))
    arms = [ArmResult("combined", "a", adherence={0: 0.0, 2: 1.0}, wall_s={2: 3.0}, retention=0.4,
                      retention_at={2: 0.4}),
            ArmResult("combined", "b", adherence={0: 0.5, 2: 0.5}, wall_s={2: 1.0}, retention=0.8,
                      retention_at={2: 0.8})]
    figures = summarize(arms, base_retention=0.8, leakage=0, config=config)
    assert figures["combined_adherence_step0"] == 0.25
    assert figures["combined_adherence_step2"] == 0.75
    assert figures["combined_retention"] == 0.75
    assert figures["combined_retention_step2"] == 0.75
    assert figures["combined_wall_s"] == 4.0


def test_only_sampled_requests_advance_the_seed():
    from bench.personalization import SimulatedUser

    user = SimulatedUser("seeded", {})
    messages = [{"role": "user", "content": "Hi"}]
    first = user.request_body(messages, greedy=False)
    greedy = user.request_body(messages, greedy=True)
    second = user.request_body(messages, greedy=False)
    assert (first["seed"], second["seed"]) == (1, 2)
    assert greedy["temperature"] == 0.0 and greedy["seed"] == 0
    assert "temperature" not in first  # sampled at the agent's own temperature


def test_the_report_names_the_jobs_that_published_nothing(tmp_path):
    from bench.personalization import ArmResult

    config = BenchConfig(methods=("combined",), checkpoints=(0, 2), out=tmp_path)
    error = "job 7 failed: KL to the previous version on the probe prompts is 2.5 > 2.0 after the first step"
    arms = [ArmResult("combined", "a", adherence={0: 0.0, 2: 1.0}, interactions={0: 0, 2: 8}, wall_s={2: 9.0},
                      jobs_failed=1, job_errors=[error]),
            ArmResult("combined", "b", adherence={0: 0.0, 2: 0.5}, interactions={0: 0, 2: 8}, wall_s={2: 9.0})]
    write_report(arms, summarize(arms, base_retention=0.8, leakage=0, config=config), config, tmp_path)
    report = (tmp_path / "results.md").read_text()
    assert f"- combined a: {error}" in report and "combined b:" not in report
    assert json.loads((tmp_path / "results.json").read_text())["arms"][0]["job_errors"] == [error]
