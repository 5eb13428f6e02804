"""Per-user and per-key rate limits: fixed one-minute windows counted in Redis (the default cache).

Counters are shared by every web process, so a limit holds across replicas. When Redis is
unreachable we let the request through and log it: chatting matters more than the limit.
"""
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import cache

logger = logging.getLogger(__name__)


def hit(scope, ident, limit, window=60):
    """Count one event for (scope, ident); return None if allowed, else the seconds until the window resets.

    Args:
        scope: what is limited ("messages", "feedback", "feedback-key").
        ident: who (a user id or an API key id).
        limit: events allowed per window; 0 or less disables the limit.
        window: window length in seconds.
    """
    if limit is None or limit <= 0:
        return None
    now = time.time()
    start = int(now // window) * window
    key = f"ratelimit:{scope}:{ident}:{start}"
    try:
        cache.add(key, 0, timeout=window + 5)
        count = cache.incr(key)
    except Exception:
        logger.warning("rate-limit counter unavailable; allowing %s for %s", scope, ident, exc_info=True)
        return None
    if count > limit:
        return max(1, int(start + window - now + 0.999))
    return None


ahit = sync_to_async(hit)


def message_limit():
    return settings.RATE_LIMIT_MESSAGES_PER_MINUTE


def feedback_limit():
    return settings.RATE_LIMIT_FEEDBACK_PER_MINUTE
