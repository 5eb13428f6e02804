"""Settings for the Daphne subprocess of the browser tests: the test settings, plus one fix.

redis-py 8 gives every connection a 5 s socket timeout, and channels_redis blocks on BZPOPMIN for
5 s (`brpop_timeout`), so on a busy machine an idle WebSocket consumer dies with "Timeout
reading from 127.0.0.1:6379" and the browser sees its socket drop mid-reply. Until
`clawplatform/settings/base.py` sets a longer socket timeout on the channel layer, this module does.
"""
from clawplatform.settings.test import *  # noqa: F401,F403
from clawplatform.settings.test import CHANNEL_LAYERS, REDIS_URL

CHANNEL_LAYERS["default"]["CONFIG"]["hosts"] = [{"address": REDIS_URL, "socket_timeout": 30}]
