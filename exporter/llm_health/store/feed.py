"""Keyspace events: one subscriber on the `del` and `expired` keyevent channels, and the
waiters' feed built on it.

Pub/Sub is fire and forget: events sent while a subscriber is disconnected are lost. So
`KeyeventSubscriber` never retries behind its owner's back (its connection has no
retries), tells its owner each time the connection is lost (`on_lost`) and each time it
is subscribed again (`on_subscribed`), and checks itself when the feed is silent: a dead
peer that never sends a reset would otherwise block it forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis import asyncio as aioredis

from ..tasks import cancel_and_wait
from .codes import LeaseArgumentError
from .connection import text, without_retries
from .keys import LeaseKeys

log = logging.getLogger(__name__)

RESUBSCRIBED = object()  # queued to every waiter after the feed was lost and re-made
STOP_GRACE_S = 1.0  # how long stop() waits for the feed's task before closing its connection
FEED_IDLE_PING_S = 15.0  # a feed silent this long sends itself a message; none back in as long: broken
FEED_LINGER_S = 10.0  # how long the waiters' feed stays subscribed after its last waiter left

RELEASE_REASONS = ("del", "expired")


def keyevent_channels(db: int) -> tuple[str, str]:
    return (f"__keyevent@{db}__:del", f"__keyevent@{db}__:expired")


def required_keyspace_command(current: str) -> str | None:
    """The ``CONFIG SET`` that adds what the waiters need and ``current`` lacks (E, the
    keyevent channels, with g, generic commands such as del, and x, expired; or A, which
    holds g and x), None if nothing is."""
    missing = ""
    if "E" not in current:
        missing += "E"
    if "A" not in current:
        missing += "".join(f for f in "gx" if f not in current)
    if not missing:
        return None
    return f"CONFIG SET notify-keyspace-events {current}{missing}"


async def subscribe_confirmed(pubsub: Any, channels: Sequence[str], deadline: float) -> None:
    """SUBSCRIBE and wait until Redis confirms every channel: only from then on are
    events guaranteed to reach us."""
    await pubsub.subscribe(*channels)
    loop = asyncio.get_running_loop()
    confirmed = 0
    while confirmed < len(channels):
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError("keyevent subscription not confirmed before the deadline")
        msg = await pubsub.get_message(timeout=left)
        if msg is not None and msg.get("type") == "subscribe":
            confirmed += 1


class FeedBase:
    """What every keyevent feed's owner sees, whatever the Redis kind: the hooks (below),
    a name for its task, `start()` and `running`. KeyeventSubscriber is one connection;
    cluster_events.ClusterKeyevents one KeyeventSubscriber per primary."""

    def __init__(
        self,
        on_event: Callable[[str, str], None],
        *,
        name: str,
        on_subscribed: Callable[[bool], None] | None,
        on_lost: Callable[[BaseException], None] | None,
        before_subscribe: Callable[[], Awaitable[None]] | None,
    ):
        self.on_event = on_event
        self.on_subscribed = on_subscribed
        self.on_lost = on_lost
        self.before_subscribe = before_subscribe
        self.name = name
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=self.name)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()


class KeyeventSubscriber(FeedBase):
    """One pub/sub connection on the `del` and `expired` keyevent channels of a database,
    kept subscribed until `stop()`.

    `on_event(reason, key)` gets every event (`reason` is `del` or `expired`).
    `before_subscribe()` runs before every (re)subscription, `on_subscribed(first)` after
    Redis confirmed it, `on_lost(error)` when the connection broke (events may be lost
    from then until the next `on_subscribed`)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        db: int,
        on_event: Callable[[str, str], None],
        *,
        name: str = "keyevents",
        on_subscribed: Callable[[bool], None] | None = None,
        on_lost: Callable[[BaseException], None] | None = None,
        before_subscribe: Callable[[], Awaitable[None]] | None = None,
        reconnect_max_s: float = 1.0,
        confirm_timeout_s: float = 5.0,
        idle_ping_s: float = FEED_IDLE_PING_S,
        sub_redis: aioredis.Redis | None = None,
        still_valid: Callable[[Any], Awaitable[bool]] | None = None,
        check_interval_s: float = 1.0,
    ):
        super().__init__(on_event, name=name, on_subscribed=on_subscribed, on_lost=on_lost, before_subscribe=before_subscribe)
        self.redis = redis  # publishes the liveness messages
        # The subscription must SEE every broken connection: no retries on it.
        self._sub_redis = sub_redis if sub_redis is not None else without_retries(redis)
        # Asked every check_interval_s with the pubsub: False (a Sentinel subscription
        # left on a demoted primary) makes the feed resubscribe.
        self.still_valid = still_valid
        self.check_interval_s = check_interval_s
        self.liveness_channel = f"llm-health:feed:{uuid.uuid4().hex}"
        self.channels = (*keyevent_channels(db), self.liveness_channel)
        self.reconnect_max_s = reconnect_max_s
        self.confirm_timeout_s = confirm_timeout_s
        self.idle_ping_s = idle_ping_s
        self.connected = False

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            # redis-py's pub/sub read can swallow a cancellation; then closing the
            # connection under it ends the read, and the loop sees _stopping.
            await cancel_and_wait(task, STOP_GRACE_S, unstick=self._sub_redis.connection_pool.disconnect)
            self._stopping = False
        self.connected = False

    async def aclose(self) -> None:
        await self.stop()
        await self._sub_redis.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.05
        first = True
        while not self._stopping:
            pubsub = self._sub_redis.pubsub()
            try:
                if self.before_subscribe is not None:
                    await self.before_subscribe()
                await subscribe_confirmed(pubsub, self.channels, loop.time() + self.confirm_timeout_s)
                self.connected = True
                if self.on_subscribed is not None:
                    self.on_subscribed(first)
                first = False
                backoff = 0.05
                await self._read(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection broke, Redis is down, a bug: retry, never die
                if self._stopping:
                    return
                was_connected, self.connected = self.connected, False
                if was_connected:
                    log.warning("%s: keyevent feed lost (%r); resubscribing", self.name, exc)
                if self.on_lost is not None:
                    self.on_lost(exc)
            finally:
                self.connected = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_s)

    async def _read(self, pubsub: Any) -> None:
        awaiting_pong = False
        loop = asyncio.get_running_loop()
        silent_since = loop.time()
        next_check = loop.time() + self.check_interval_s
        while True:
            timeout = self.idle_ping_s if self.still_valid is None else max(0.0, min(next_check, silent_since + self.idle_ping_s) - loop.time())
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
            if self.still_valid is not None and loop.time() >= next_check:
                next_check = loop.time() + self.check_interval_s
                if not await self.still_valid(pubsub):
                    raise ConnectionError("keyevent feed: the server it is subscribed on is no longer the primary")
            if msg is None and loop.time() < silent_since + self.idle_ping_s:
                continue
            if msg is None:
                silent_since = loop.time()
                # Silence: send ourselves a message; if it does not come back, the feed is broken.
                if awaiting_pong:
                    raise TimeoutError("keyevent feed: our own liveness message did not come back")
                await self.redis.publish(self.liveness_channel, "1")
                awaiting_pong = True
                continue
            awaiting_pong = False
            silent_since = loop.time()
            if msg.get("type") != "message":
                continue
            reason = text(msg["channel"]).rsplit(":", 1)[-1]
            if reason in RELEASE_REASONS:
                self.on_event(reason, text(msg["data"]))


class KeyeventFeed:
    """The waiters' feed: subscribed while at least one waiter of the client waits, and
    for `linger_s` after the last one left (0: unsubscribed as it leaves). A waiter that
    comes back within it finds the feed subscribed: no SUBSCRIBE round trip (one per
    primary on Cluster) before its first claim, no UNSUBSCRIBE after its last.

    Each lease event goes, as ``(gpu, reason)``, to ONE local waiter whose pool has that
    GPU: the longest-waiting one with nothing queued, else the longest-waiting one. One
    claim per process per release is enough: if it fails, another process holds the GPU
    and no other local waiter could have won it. Waking every local waiter instead
    would send N claims per release (a thundering herd). A waiter that leaves with
    events still queued hands them on. If the connection breaks it is made again and
    every waiter gets RESUBSCRIBED (then all re-check: events were lost)."""

    def __init__(self, deployment: Any, keys: LeaseKeys, reconnect_max_s: float = 1.0, linger_s: float = FEED_LINGER_S):
        if linger_s < 0:
            raise LeaseArgumentError(f"linger_s must be 0 or more, not {linger_s}")
        self.keys = keys
        self.linger_s = linger_s
        self.waiters: dict[asyncio.Queue[Any], set[str]] = {}
        self._live = asyncio.Event()
        self._lock = asyncio.Lock()
        self._idle_since = 0.0  # loop time the last waiter left
        self._linger: asyncio.Task[None] | None = None  # stops the feed once idle for linger_s
        self._lingering = False  # the linger task is asleep (the only place it may be cancelled)
        # One subscription (one server, Sentinel's primary) or one per primary (Cluster).
        self.subscriber = deployment.keyevent_subscriber(
            self._on_event,
            name="lease-keyevent-feed",
            on_subscribed=self._subscribed,
            on_lost=lambda exc: self._live.clear(),
            reconnect_max_s=reconnect_max_s,
        )

    @property
    def liveness_channel(self) -> str:
        return self.subscriber.liveness_channel

    async def join(self, gpus: set[str], deadline: float) -> asyncio.Queue[Any]:
        """A queue of this waiter's events, once Redis confirmed the subscription;
        TimeoutError if that does not happen before `deadline` (loop time)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.waiters[queue] = gpus
        try:
            async with self._lock:
                self.subscriber.start()
            left = deadline - asyncio.get_running_loop().time()
            async with asyncio.timeout(max(left, 0.001)):
                await self._live.wait()  # the feed may be (re)subscribing
        except BaseException:
            await self.leave(queue)
            raise
        return queue

    async def leave(self, queue: asyncio.Queue[Any]) -> None:
        self.waiters.pop(queue, None)
        while not queue.empty():  # events it did not get to: hand them on
            event = queue.get_nowait()
            if event is not RESUBSCRIBED:
                self._dispatch(*event)
        if self.waiters:
            return
        if self.linger_s > 0:
            self._idle_since = asyncio.get_running_loop().time()
            if self._linger is None or self._linger.done():
                self._linger = asyncio.create_task(self._stop_when_idle(), name="lease-keyevent-feed-linger")
            return
        await self._stop_if_idle()

    async def _stop_when_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            left = self._idle_since + self.linger_s - loop.time()
            if self.waiters:  # the next waiter to leave starts a new one
                return
            if left <= 0:
                break
            self._lingering = True
            try:
                await asyncio.sleep(left)
            except asyncio.CancelledError:
                return
            finally:
                self._lingering = False
        await self._stop_if_idle()

    async def _stop_if_idle(self) -> None:
        async with self._lock:
            if self.waiters:  # someone joined meanwhile: keep the feed
                return
            self._live.clear()
            await self.subscriber.stop()

    async def aclose(self) -> None:
        task, self._linger = self._linger, None
        if task is not None:
            if self._lingering:
                task.cancel()
            with contextlib.suppress(BaseException):
                await task  # asleep: cancelled; stopping the feed: let it finish
        await self.subscriber.aclose()

    def _subscribed(self, first: bool) -> None:
        self._live.set()
        if not first:
            for queue in list(self.waiters):
                queue.put_nowait(RESUBSCRIBED)

    def _on_event(self, reason: str, key: str) -> None:
        gpu = self.keys.gpu_of(key)
        if gpu is not None:
            self._dispatch(gpu, reason)

    def _dispatch(self, gpu: str, reason: str) -> None:
        fallback: asyncio.Queue[Any] | None = None
        for queue, gpus in self.waiters.items():  # in join order: longest waiting first
            if gpu in gpus:
                if queue.empty():
                    queue.put_nowait((gpu, reason))
                    return
                if fallback is None:
                    fallback = queue
        if fallback is not None:
            fallback.put_nowait((gpu, reason))
