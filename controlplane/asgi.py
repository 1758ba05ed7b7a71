"""ASGI entry point: Django over HTTP and Channels consumers over WebSocket (``controlplane.web`` serves it).

HTTP goes to Django's ASGI handler with its middleware chain run as under WSGI, one worker-thread hop per
request (:mod:`apps.core.asgi_handler`). Routers' routing-table polls with the service token are answered from
Redis before Django (:class:`apps.fleet.routing_table_cache.RoutingTableFastPath`); requests cut off by the
server's shutdown are not reported as tracebacks (:mod:`apps.core.asgi_shutdown`)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
if os.environ.get("FERRY_TRACE_RATIO"):  # Actions traced web -> Celery -> backend (controlplane.tracing)
    from controlplane.tracing import instrument_web

    instrument_web()
from apps.core.asgi_handler import sync_chain_asgi_application  # noqa: E402

django_asgi_app = sync_chain_asgi_application()  # set up Django before importing consumers

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from apps.core.asgi_shutdown import QuietAborts  # noqa: E402
from apps.fleet.routing_table_cache import RoutingTableFastPath  # noqa: E402
from controlplane.websocket_urls import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # a request cut off by the server's shutdown is not a traceback (apps.core.asgi_shutdown)
        "http": QuietAborts(RoutingTableFastPath(django_asgi_app)),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
