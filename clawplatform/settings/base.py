"""Settings shared by every environment. Every value comes from an env var with a default.

The README's configuration table lists each one; tests/test_settings.py checks they take effect.
"""
import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent.parent


def env(name, default=None):
    return os.environ.get(name, default)


def env_bool(name, default):
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def env_float(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


def env_list(name, default):
    value = os.environ.get(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


# GENERAL
# ------------------------------------------------------------------------------
# https://docs.djangoproject.com/en/5.2/ref/settings/
DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env("SECRET_KEY", "insecure-dev-key-change-me")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
TIME_ZONE = env("TIME_ZONE", "UTC")
LANGUAGE_CODE = "en-us"
USE_I18N = True
USE_TZ = True
DATA_DIR = Path(env("DATA_DIR", str(BASE_DIR / "var"))).resolve()
# transformers and peft ask the Hugging Face hub for files (a config, a tokenizer) unless the hub is
# off; they read this when first imported, which is after the settings. MODEL is a local
# directory unless a deployment lets them fetch it (HF_HUB_OFFLINE=0, as docker-compose.yml does).
HF_HUB_OFFLINE = env_bool("HF_HUB_OFFLINE", True)
os.environ["HF_HUB_OFFLINE"] = "1" if HF_HUB_OFFLINE else "0"

# DATABASES
# ------------------------------------------------------------------------------
# https://docs.djangoproject.com/en/5.2/ref/settings/#databases (PostgreSQL only)
DATABASE_URL = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/clawplatform")
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise RuntimeError("DATABASE_URL must point at PostgreSQL; other databases are not supported.")
DATABASES["default"]["ATOMIC_REQUESTS"] = True
DATABASES["default"].setdefault("OPTIONS", {})["connect_timeout"] = env_int("DATABASE_CONNECT_TIMEOUT", 5)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# REDIS (Celery broker, Channels layer, cache, rate limits)
# ------------------------------------------------------------------------------
REDIS_URL = env("REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_KEY_PREFIX = env("REDIS_KEY_PREFIX", "claw")

# APPS
# ------------------------------------------------------------------------------
INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "channels",
    "serving",
    "chat",
    "training",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "training.metrics.RequestCountMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # A PostgreSQL outage answers 503 with a clear message, not a 500 page.
    "chat.middleware.DatabaseUnavailableMiddleware",
]

ROOT_URLCONF = "clawplatform.urls"
ASGI_APPLICATION = "clawplatform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# AUTH
# ------------------------------------------------------------------------------
# https://docs.djangoproject.com/en/5.2/topics/auth/
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "chat:home"
LOGOUT_REDIRECT_URL = "login"
SIGNUP_OPEN = env_bool("SIGNUP_OPEN", True)

# STATIC
# ------------------------------------------------------------------------------
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"

# CHANNELS
# ------------------------------------------------------------------------------
# https://channels.readthedocs.io/en/latest/topics/channel_layers.html
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # redis-py gives each connection a 5 s socket timeout and channels_redis blocks 5 s in
        # BZPOPMIN, so on a busy machine an idle consumer died with "Timeout reading from redis".
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}], "prefix": f"{REDIS_KEY_PREFIX}:asgi",
                   "capacity": 1000},
    }
}

# CACHE (rate-limit counters live here, in Redis)
# ------------------------------------------------------------------------------
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": REDIS_KEY_PREFIX,
        "OPTIONS": {"socket_connect_timeout": 2, "socket_timeout": 2},
    }
}

# CELERY
# ------------------------------------------------------------------------------
# https://docs.celeryq.dev/en/stable/userguide/configuration.html
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {"training.tasks.run_training_job": {"queue": "training"}}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 3600)
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 3300)
# Above the longest job, or Redis hands an unacked job to a second worker.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 7200),
    "global_keyprefix": f"{REDIS_KEY_PREFIX}:celery:",
}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    "enforce-adapter-retention": {"task": "training.tasks.enforce_adapter_retention", "schedule": 3600.0},
    "requeue-unprocessed-feedback": {"task": "training.tasks.requeue_unprocessed_feedback", "schedule": 60.0},
}

# MODEL AND SERVING
# ------------------------------------------------------------------------------
# MODEL: any Hugging Face checkpoint directory; unset, the locally built demo model.
DEMO_MODEL_DIR = DATA_DIR / "models" / "demo-chat"
MODEL = env("MODEL", str(DEMO_MODEL_DIR))
# Name the inference servers know the base model by (vLLM's --served-model-name).
SERVED_MODEL_NAME = env("SERVED_MODEL_NAME", "base")
# One or more vLLM-compatible endpoints (vLLM replicas, or `manage.py serve_model`).
INFERENCE_URLS = env_list("INFERENCE_URL", ["http://127.0.0.1:8001"])
INFERENCE_TIMEOUT = env_float("INFERENCE_TIMEOUT", 120.0)
ADAPTER_ROOT = Path(env("ADAPTER_ROOT", str(DATA_DIR / "adapters"))).resolve()
ADAPTER_KEEP_LAST = env_int("ADAPTER_KEEP_LAST", 10)
ENGINE_MAX_LOADED_ADAPTERS = env_int("ENGINE_MAX_LOADED_ADAPTERS", 64)
ENGINE_MAX_BATCH = env_int("ENGINE_MAX_BATCH", 32)
# Context length the prompt is cut to; 0 means the model config's max_position_embeddings.
MODEL_MAX_CONTEXT = env_int("MODEL_MAX_CONTEXT", 0)

# TRAINING
# ------------------------------------------------------------------------------
TRAIN_BATCH_SIZE = env_int("TRAIN_BATCH_SIZE", 4)
TRAIN_DEVICE = env("TRAIN_DEVICE", "auto")
# Review policy: feedback per user per hour beyond which new feedback is held for review.
TRAINING_HOLD_FEEDBACK_PER_HOUR = env_int("TRAINING_HOLD_FEEDBACK_PER_HOUR", 120)
# LLM judge: votes per comment (majority wins) and the longest judge answer, in tokens.
TRAINING_JUDGE_VOTES = env_int("TRAINING_JUDGE_VOTES", 3)
TRAINING_JUDGE_MAX_TOKENS = env_int("TRAINING_JUDGE_MAX_TOKENS", 512)

# LIMITS
# ------------------------------------------------------------------------------
MAX_MESSAGE_CHARS = env_int("MAX_MESSAGE_CHARS", 8000)
MAX_CORRECTION_CHARS = env_int("MAX_CORRECTION_CHARS", 8000)
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("MAX_REQUEST_BYTES", 1_000_000)
RATE_LIMIT_MESSAGES_PER_MINUTE = env_int("RATE_LIMIT_MESSAGES_PER_MINUTE", 30)
RATE_LIMIT_FEEDBACK_PER_MINUTE = env_int("RATE_LIMIT_FEEDBACK_PER_MINUTE", 60)
METRICS_TOKEN = env("METRICS_TOKEN", "")

# LOGGING
# ------------------------------------------------------------------------------
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", "INFO")},
}
