"""Who is calling: a session user (browser, CSRF enforced) or the owner of an API key."""
import hmac

from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone

from .models import ApiKey


class AuthFailed(Exception):
    def __init__(self, message, status=401):
        super().__init__(message)
        self.message = message
        self.status = status


def bearer_token(request):
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def authenticate_key(raw):
    """The live ApiKey for a raw key, with `last_used_at` updated, or None."""
    if not raw:
        return None
    digest = ApiKey.hash(raw)
    key = ApiKey.objects.select_related("user").filter(key_hash=digest).first()
    # The lookup is by hash already; compare again in constant time so timing tells nothing.
    if key is None or not hmac.compare_digest(key.key_hash, digest):
        return None
    if key.revoked_at is not None or not key.user.is_active:
        return None
    now = timezone.now()
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
    key.last_used_at = now
    return key


def _csrf_failure(request):
    check = CsrfViewMiddleware(lambda req: None)
    check.process_request(request)
    response = check.process_view(request, None, (), {})
    return response is not None


def authenticate(request, *, allow_session=True):
    """Return (user, api_key_or_None) for a request, or raise AuthFailed.

    A Bearer header wins over the session and skips CSRF (a key is not ambient authority).
    Session users must pass Django's CSRF check on unsafe methods.
    """
    raw = bearer_token(request)
    if raw is not None:
        key = authenticate_key(raw)
        if key is None:
            raise AuthFailed("Invalid or revoked API key.")
        return key.user, key
    if not allow_session:
        raise AuthFailed("An API key is required: send 'Authorization: Bearer <key>'.")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        raise AuthFailed("Authentication required.")
    if request.method not in ("GET", "HEAD", "OPTIONS", "TRACE") and _csrf_failure(request):
        raise AuthFailed("CSRF check failed.", status=403)
    return user, None
