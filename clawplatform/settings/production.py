"""Settings for deployments behind a TLS-terminating proxy (docker-compose, Kubernetes)."""
from .base import *  # noqa: F401,F403
from .base import env, env_bool, env_int

DEBUG = False
SECRET_KEY = env("SECRET_KEY")
if not SECRET_KEY:
    raise RuntimeError("SECRET_KEY must be set in production.")

# SECURITY
# ------------------------------------------------------------------------------
# https://docs.djangoproject.com/en/5.2/howto/deployment/checklist/
# The proxy in front (nginx, Traefik, a cloud load balancer) must set X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
CSRF_TRUSTED_ORIGINS = [o for o in env("CSRF_TRUSTED_ORIGINS", "").split(",") if o]
# /healthz is probed over plain HTTP inside the cluster.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
