"""Settings for the test suite: real PostgreSQL and Redis, one database and key prefix per run."""
import os
import uuid
from pathlib import Path

from .base import *  # noqa: F401,F403
from .base import CELERY_BROKER_TRANSPORT_OPTIONS, CHANNEL_LAYERS, DATABASES, DATA_DIR, env

RUN_ID = os.environ.setdefault("CLAW_TEST_RUN_ID", uuid.uuid4().hex[:8])

DEBUG = False
SECRET_KEY = "test-secret-key"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES["default"]["TEST"] = {"NAME": f"test_claw_{RUN_ID}"}
REDIS_KEY_PREFIX = f"claw-test-{RUN_ID}"
CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = f"{REDIS_KEY_PREFIX}:asgi"
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": env("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "KEY_PREFIX": REDIS_KEY_PREFIX,
    }
}
CELERY_BROKER_TRANSPORT_OPTIONS = {**CELERY_BROKER_TRANSPORT_OPTIONS, "global_keyprefix": f"{REDIS_KEY_PREFIX}:celery:", "visibility_timeout": 20}
TEST_DATA_DIR = DATA_DIR / "test" / RUN_ID
# A test's subprocess (tools.devservices.test_subprocess_env) gets the test's own adapter root.
ADAPTER_ROOT = Path(env("ADAPTER_ROOT", str(TEST_DATA_DIR / "adapters"))).resolve()
