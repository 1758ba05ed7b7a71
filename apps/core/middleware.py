"""Under ``/api/``, every client error is JSON in DRF's shape (``{"detail": "..."}``), never Django's HTML page.

DRF answers errors raised in its views as JSON, but a request that reaches no view got Django's page: an unknown
path such as ``GET /api/v1/nope/`` answered an HTML 404 (with ``DEBUG``, the technical 404 page listing the URL
patterns: Django renders it without calling ``handler404``, so a custom handler would not cover ``make run``).
:class:`ApiJsonErrorsMiddleware` replaces such a response, and a write sent to an API path without its trailing
slash, which Django's ``CommonMiddleware`` answered with a 301 that clients follow as a ``GET`` (the body dropped
without a word; with ``DEBUG``, a 500), answers 404 naming the path to use. Paths outside ``/api/`` (dashboard,
admin) keep Django's HTML pages.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.urls import is_valid_path
from rest_framework.response import Response

API_PREFIX = "/api/"
"""Paths under it are the REST API's (``controlplane.urls``)."""

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
API_ROOT_HINT = "GET /api/v1/ lists the API's collections."


def _is_json(response: HttpResponseBase) -> bool:
    return response.get("Content-Type", "").split(";")[0].strip().endswith("json")


class ApiJsonErrorsMiddleware:
    """Answer a client error (4xx) under :data:`API_PREFIX` that DRF did not render as JSON ``{"detail": "..."}``
    with the same status (and ``Allow`` header, on a 405); a write to an API path lacking its trailing slash is a
    JSON 404 naming the path with the slash.

    DRF's own responses pass unchanged (its JSON errors, and the browsable API's HTML for a browser), as do
    successes, redirects and server errors. First in ``MIDDLEWARE``, so it also sees the responses other middleware
    gives. Raises nothing of its own.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if not request.path_info.startswith(API_PREFIX):
            return self.get_response(request)
        if request.method not in SAFE_METHODS and self._lacks_slash(request):
            return JsonResponse({"detail": (
                f"Not found: no API endpoint at {request.path}. API paths end with a slash: send the "
                f"{request.method} to {request.path}/ (a redirect would turn it into a GET and drop its body).")},
                status=404)
        response = self.get_response(request)
        if 400 <= response.status_code < 500 and not isinstance(response, Response) and not _is_json(response):
            return self._as_json(request, response)
        return response

    @staticmethod
    def _lacks_slash(request: HttpRequest) -> bool:
        """True when ``request``'s path matches no route but the path with a trailing slash does."""
        path, urlconf = request.path_info, getattr(request, "urlconf", None)
        return not path.endswith("/") and not is_valid_path(path, urlconf) and bool(is_valid_path(f"{path}/", urlconf))

    @staticmethod
    def _as_json(request: HttpRequest, response: HttpResponseBase) -> JsonResponse:
        if response.status_code == 404:
            detail = f"Not found: no API endpoint at {request.path}. {API_ROOT_HINT}"
        elif response.status_code == 405:
            detail = f'Method "{request.method}" not allowed on {request.path}.'
        else:
            detail = f"{response.reason_phrase}."
        answer = JsonResponse({"detail": detail}, status=response.status_code)
        if response.has_header("Allow"):
            answer["Allow"] = response["Allow"]
        return answer
