"""How many chat sockets are open, across every web process: one counter in Redis.

The consumer counts itself in on connect and out on disconnect; `/metrics` reads the total.
A process killed without running `disconnect` leaves its sockets counted until Redis loses the
key, so the reader clamps at zero and operators compare it with the web processes' uptime.
"""
import functools
import logging

import redis
from asgiref.sync import sync_to_async
from django.conf import settings

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _client(url):
    return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)


def redis_client():
    """A short-timeout Redis client for `REDIS_URL` (metrics must never stall a request)."""
    return _client(settings.REDIS_URL)


def key():
    return f"{settings.REDIS_KEY_PREFIX}:metrics:websockets"


def _add(delta):
    try:
        redis_client().incrby(key(), delta)
    except redis.RedisError:  # a missed count only skews a gauge; chatting goes on
        logger.warning("could not count a socket %s", "in" if delta > 0 else "out", exc_info=True)


def socket_opened():
    _add(1)


def socket_closed():
    _add(-1)


asocket_opened = sync_to_async(socket_opened, thread_sensitive=False)
asocket_closed = sync_to_async(socket_closed, thread_sensitive=False)


def open_sockets():
    """The number of chat sockets open now (never negative); None if Redis can't be read."""
    try:
        value = redis_client().get(key())
    except redis.RedisError:
        return None
    return max(0, int(value or 0))
