"""Keyevents on Redis Cluster: keyspace notifications are node-local, so the feed is one
subscription per primary, re-made as primaries change (store.deployment_cluster makes it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import ERRORS
from .feed import FeedBase, KeyeventSubscriber

TOPOLOGY_CHECK_S = 1.0  # how often the feed asks where the primaries are


class ClusterKeyevents(FeedBase):
    """Keyevents on Redis Cluster: one :class:`KeyeventSubscriber` per primary (keyspace
    notifications are node-local), re-made as primaries change. Same interface as a
    KeyeventSubscriber for its owner: ``connected`` only while every primary's feed is;
    ``on_lost`` when any feed breaks; ``on_subscribed(first)`` each time every primary
    is subscribed again, so events lost in between are re-checked by the owner."""

    def __init__(
        self,
        deployment: Any,  # store.deployment_cluster.ClusterDeployment (which imports this module)
        on_event: Callable[[str, str], None],
        *,
        name: str = "keyevents",
        on_subscribed: Callable[[bool], None] | None = None,
        on_lost: Callable[[BaseException], None] | None = None,
        before_subscribe: Callable[[], Awaitable[None]] | None = None,
        reconnect_max_s: float = 1.0,
        confirm_timeout_s: float = 5.0,
        idle_ping_s: float | None = None,
    ):
        super().__init__(on_event, name=name, on_subscribed=on_subscribed, on_lost=on_lost, before_subscribe=before_subscribe)
        self.deployment = deployment
        self._kw: dict[str, Any] = {"reconnect_max_s": reconnect_max_s, "confirm_timeout_s": confirm_timeout_s}
        if idle_ping_s is not None:
            self._kw["idle_ping_s"] = idle_ping_s
        self.subs: dict[tuple[str, int], KeyeventSubscriber] = {}
        self._ever_all = False
        self._hook_lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return bool(self.subs) and all(s.connected for s in self.subs.values())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # On Python 3.11 a redis-py command can swallow the cancellation (its
            # asyncio.wait_for, CPython gh-86296): the loop then ends at its next check.
            self._stopping = True
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            self._stopping = False
        for sub in list(self.subs.values()):
            await sub.aclose()
        self.subs.clear()
        # A feed started again later starts afresh: its first full subscription is a
        # first, not a topology change (no failover counted, no re-check queued).
        self._ever_all = False

    async def aclose(self) -> None:
        await self.stop()

    def _make(self, addr: tuple[str, int]) -> KeyeventSubscriber:
        node = self.deployment.node(*addr)
        sub = KeyeventSubscriber(
            node,
            0,
            self.on_event,
            name=f"{self.name}@{addr[0]}:{addr[1]}",
            on_subscribed=lambda first: self._node_subscribed(),
            on_lost=self._node_lost,
            before_subscribe=self._before_subscribe if self.before_subscribe is not None else None,
            **self._kw,
        )
        return sub

    async def _before_subscribe(self) -> None:
        # One node at a time: the owner's hook (the view's gap repair) must not run
        # three times over the same state when every feed was cut at once.
        assert self.before_subscribe is not None
        async with self._hook_lock:
            await self.before_subscribe()

    def _node_subscribed(self) -> None:
        if self.connected and self.on_subscribed is not None:
            first, self._ever_all = not self._ever_all, True
            self.on_subscribed(first)

    def _node_lost(self, exc: BaseException) -> None:
        if self.on_lost is not None:
            self.on_lost(exc)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                primaries = set(await self.deployment.primaries())
            except ERRORS as exc:
                self._node_lost(exc)
                await asyncio.sleep(TOPOLOGY_CHECK_S)
                continue
            if self._stopping:
                return
            gone = [a for a in self.subs if a not in primaries]
            new = [a for a in primaries if a not in self.subs]
            for addr in gone:  # no longer a primary: its events are not the cluster's
                await self.subs.pop(addr).aclose()
            for addr in new:
                sub = self._make(addr)
                self.subs[addr] = sub
                sub.start()
            if gone or new:
                if self._ever_all:
                    self.deployment.failovers_seen += 1
                    # The new primary's feed calls _node_subscribed once confirmed; a
                    # demoted one removed alone means every remaining feed is live.
                    if self.on_lost is not None and new:
                        self.on_lost(ConnectionError(f"cluster topology changed: +{new} -{gone}"))
                    if not new:
                        self._node_subscribed()
                await self.deployment.refresh_topology()
            await asyncio.sleep(TOPOLOGY_CHECK_S)
