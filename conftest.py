"""Fixtures shared by every app's tests: a tiny demo model, users and logged-in clients."""
from pathlib import Path

import pytest
from django.conf import settings

REPO = Path(__file__).resolve().parent
# Built once and reused across runs: building is deterministic for a given config.
TINY_MODEL_CACHE = REPO / "var" / "test-cache"


@pytest.fixture(scope="session")
def tiny_model_dir():
    """A tiny demo chat model (real tokenizer + Qwen2 weights), built once per machine."""
    from serving.demo_model import DemoModelConfig, build_demo_model

    config = DemoModelConfig.tiny()
    return build_demo_model(TINY_MODEL_CACHE / f"tiny-{config.fingerprint()}", config, progress=False)


@pytest.fixture(autouse=True)
def _isolated_adapter_root(settings, tmp_path):
    settings.ADAPTER_ROOT = tmp_path / "adapters"
    settings.ADAPTER_ROOT.mkdir()


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw-alice-123!")


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="pw-mallory-123!")


@pytest.fixture
def staff_user(django_user_model):
    return django_user_model.objects.create_user(username="sam", password="pw-sam-123!", is_staff=True)


def pytest_collection_modifyitems(config, items):
    """Browser tests run last: Playwright's sync API keeps an event loop running in the main
    thread for the rest of the session, which breaks every async test collected after it."""
    items.sort(key=lambda item: item.get_closest_marker("browser") is not None)
