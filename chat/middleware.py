"""A database outage answers 503 with a clear message instead of a 500 error page.

While PostgreSQL is down (restarting, failing over) every request that touches it raises
`OperationalError` or `InterfaceError`. The JSON APIs (`/api/`, `/v1/`) answer with their usual
error shape and `Retry-After`; pages answer with a short plain page. With `CONN_HEALTH_CHECKS`
on and no persistent connections, the first request after PostgreSQL is back succeeds again.
"""
import logging

from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse
from django.utils.deprecation import MiddlewareMixin

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5
MESSAGE = "The database is unavailable right now. Please try again in a few seconds."


class DatabaseUnavailableMiddleware(MiddlewareMixin):
    def process_exception(self, request, exception):
        if not isinstance(exception, (OperationalError, InterfaceError)):
            return None
        logger.warning("database unavailable during %s %s: %s", request.method, request.path, exception)
        if request.path.startswith(("/api/", "/v1/")):
            body = {"error": {"message": MESSAGE, "type": "service_unavailable", "param": None,
                              "code": "database_unavailable"}}
            response = JsonResponse(body, status=503)
        else:
            response = HttpResponse(
                "<!doctype html><title>Service unavailable</title>"
                f"<h1>Service unavailable</h1><p>{MESSAGE}</p>",
                status=503, content_type="text/html; charset=utf-8",
            )
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
