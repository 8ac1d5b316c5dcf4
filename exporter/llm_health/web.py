"""What the three servers (exporter, gate, restarter) share over HTTP: running the app,
the `/metrics` handler, bearer-token checks, TLS and basic auth from `--web.config.file`
(config.web), `/-/healthy` and `/-/reload`.

`/metrics` negotiates the exposition format with the scraper (`Accept`), as
prometheus_client's own handlers do. `/-/reload` (POST) and SIGHUP re-read the
configuration file; a bad file is refused with its error and the running
configuration is kept.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gc
import hashlib
import hmac
import logging
import signal
import ssl
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry

from .config.errors import ConfigError
from .config.web import WebConfig

log = logging.getLogger("llm_health.web")

Handler = Callable[[web.Request], Awaitable[web.Response]]
Reload = Callable[[], Awaitable[str]]
Encoder = Callable[[CollectorRegistry], bytes]


class Render(Protocol):
    """The seam of `/metrics`: the whole exposition in the encoder's format, or None where
    it cannot write that format. The fast path, exporter.fast_exposition's
    `Exposition.render`, copies text the rounds rendered; its library counterpart,
    `RegistryRender`, is prometheus_client's encoder over a registry, which also serves
    every format the fast path declines (tests/unit/test_fast_exposition_parity.py)."""

    def __call__(self, encoder: Encoder) -> bytes | None: ...


class RegistryRender:
    """prometheus_client's own rendering of `registry`, in every format it writes: a Render
    that never declines."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def __call__(self, encoder: Encoder) -> bytes:
        return encoder(self.registry)


# gzip level 1: on an exporter's large scrape much smaller and fast, where the default
# level 6 is slower for little more (the figures: bench_scale in docs/benchmarks.md).
GZIP_LEVEL = 1
GZIP_IN_THREAD_OVER = 1 << 20  # bytes: a larger body is compressed off the event loop


def gzip_body(body: bytes) -> bytes:
    c = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # 16+: a gzip header
    return c.compress(body) + c.flush()


_LIBRARY: type[Render] = RegistryRender  # mypy holds the library counterpart to the seam too


def metrics_handler(registry: CollectorRegistry, render: Render | None = None, compress: bool = False) -> Handler:
    """A `/metrics` handler for `registry`, in the format the scraper asks for: from
    `render` where it writes that format, else by the encoder over `registry`. With
    `compress`, gzip where the scraper accepts it (Prometheus does), as prometheus_client's
    own handlers do; a large body in a thread (zlib lets go of the GIL), so the rounds go on."""

    library = RegistryRender(registry)

    async def handle(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = render(encoder) if render is not None else None
        if body is None:
            body = library(encoder)
        headers = {"Content-Type": content_type}
        if compress:
            headers["Vary"] = "Accept-Encoding"
            if gzip_accepted(request.headers.get("Accept-Encoding", "")):
                body = await asyncio.to_thread(gzip_body, body) if len(body) > GZIP_IN_THREAD_OVER else gzip_body(body)
                headers["Content-Encoding"] = "gzip"
        return web.Response(body=body, headers=headers)

    return handle


async def healthy(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


class BearerToken:
    """Checks `Authorization: Bearer <token>` in constant time: equal-length digests are
    compared, so neither the token nor its length leaks through timing."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("a bearer token must not be empty")
        self._digest = hashlib.sha256(token.encode()).digest()

    def check(self, request: web.Request) -> bool:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        offered = hashlib.sha256(credentials.strip().encode()).digest()
        return hmac.compare_digest(offered, self._digest) and scheme.lower() == "bearer"


# Paths an orchestrator's probes and load balancers' health checks call without
# credentials: they tell nothing but "alive" or "ready" (and a backend's state in a word).
OPEN_PATHS = frozenset({"/-/healthy", "/-/live", "/-/ready"})
USER_KEY = "llm_health_basic_auth_user"  # set on a request that passed basic auth
_DUMMY_HASH = b"$2b$10$" + b"." * 53  # checked against for unknown users: same cost either way


class BasicAuth:
    """basic_auth_users of a web config: bcrypt checks off the event loop, at most two at
    a time (each costs tens of milliseconds of CPU by design), successful ones remembered
    by a digest of user and password so a scraper pays once."""

    def __init__(self, users: dict[str, bytes]):
        self.users = users
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._slots = asyncio.Semaphore(2)

    async def user(self, request: web.Request) -> str | None:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, sep, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        if not sep:
            return None
        hashed = self.users.get(user)
        key = hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed or b""))).digest()
        if hashed is not None and key in self._ok:
            self._ok.move_to_end(key)
            return user
        import bcrypt  # the `auth` extra; config.web checked it is installed

        async with self._slots:
            try:
                ok = await asyncio.to_thread(bcrypt.checkpw, password.encode(), hashed or _DUMMY_HASH)
            except ValueError:  # bcrypt 5 refuses passwords over 72 bytes: a wrong one, not a 500
                ok = False
        if not ok or hashed is None:
            return None
        self._ok[key] = None
        while len(self._ok) > 1024:
            self._ok.popitem(last=False)
        return user


def secure(app: web.Application, config: WebConfig, protected: Callable[[web.Request], bool] | None = None) -> None:
    """Basic auth (when the web config has users) on every request `protected` says needs
    it (default: all but OPEN_PATHS), and the web config's response headers."""
    auth = BasicAuth(config.users) if config.users else None

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        # The configured headers go on every answer, refusals and errors included, as
        # exporter-toolkit sets them.
        needs = protected(request) if protected is not None else request.path not in OPEN_PATHS
        response: web.StreamResponse
        if auth is not None and needs and (user := await auth.user(request)) is None:
            response = web.Response(status=401, text="unauthorised\n", headers={"WWW-Authenticate": 'Basic realm="llm-health"'})
        else:
            if auth is not None and needs:
                request[USER_KEY] = user
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                for name, value in config.headers.items():
                    exc.headers.setdefault(name, value)
                raise
        for name, value in config.headers.items():
            response.headers.setdefault(name, value)
        return response

    app.middlewares.append(middleware)


def add_reload(app: web.Application, reload: Reload) -> None:
    """`POST /-/reload` and SIGHUP call `reload()`, which returns what changed or raises
    ConfigError (the running configuration is then kept)."""
    lock = asyncio.Lock()
    pending: set[asyncio.Future[tuple[bool, str]]] = set()

    async def run() -> tuple[bool, str]:
        async with lock:
            try:
                what = await reload()
            except ConfigError as exc:
                log.error("reload refused, configuration kept: %s", exc)
                return False, str(exc)
            log.info("configuration reloaded: %s", what)
            return True, what

    async def handle(request: web.Request) -> web.Response:
        ok, what = await run()
        return web.json_response({"reloaded": ok, "detail": what}, status=200 if ok else 400)

    def on_hup() -> None:
        task = asyncio.ensure_future(run())
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def on_startup(app: web.Application) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hup)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests), or no signals
            pass

    async def on_cleanup(app: web.Application) -> None:
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (NotImplementedError, RuntimeError):
            pass

    app.router.add_post("/-/reload", handle)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)


def run_with(app: web.Application, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """``start()`` as ``app`` starts serving, ``stop()`` as it shuts down (its cleanup)."""

    async def lifecycle(_app: web.Application) -> AsyncIterator[None]:
        await start()
        yield
        await stop()

    app.cleanup_ctx.append(lifecycle)


def freeze_after_startup(app: web.Application) -> None:
    """Once the app has started, move every object alive then (modules, configuration,
    the backends' slots) out of the garbage collector's sight: a full collection then
    walks only what the rounds allocate since, and no longer holds the event loop for tens
    of milliseconds while a large payload is read (bench/bench_hostile.py)."""

    async def freeze(_app: web.Application) -> None:
        gc.freeze()

    app.on_startup.append(freeze)


def run_app(app: web.Application, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None, **kw: Any) -> None:
    """aiohttp's run_app, on uvloop where it is installed (about a third less CPU per
    request), without an access log, the garbage collector frozen after startup."""
    freeze_after_startup(app)
    try:
        import uvloop
    except ImportError:  # the `gate` extra brings it; the others run on asyncio's loop
        loop = None
    else:
        loop = uvloop.new_event_loop()
    web.run_app(app, host=host, port=port, access_log=None, print=None, loop=loop, ssl_context=ssl_context, **kw)
