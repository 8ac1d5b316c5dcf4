"""What a bad config, a typo on a watchdog's command line, a black-holed Redis connection
or a Redis restarted without persistence can do. Real processes: `llm-health` commands,
redis-server, a TCP proxy that drops packets. Each test names the row of the hostile-input
table it answers; each failed on the code before its fix."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from llm_health.store.leases import LeaseClient
from llm_health.store.records import LeaseLost, Pool


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llm_health", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "text,key",
    [
        ("global: {interval: .nan}\n", "global.interval"),
        ("global: {interval: .inf}\n", "global.interval"),
        ("global: {hung_after_seconds: .inf}\n", "global.hung_after_seconds"),
        ("global: {hung_after_seconds: .nan}\n", "global.hung_after_seconds"),
        ("restarter: {budget: {window: .inf}}\nbackends:\n  - {name: a, url: 'http://127.0.0.1:1', restart: [/bin/true]}\n", "restarter.budget.window"),
        ("restarter: {verify: {interval: .nan}}\nbackends:\n  - {name: a, url: 'http://127.0.0.1:1', restart: [/bin/true]}\n", "restarter.verify.interval"),
        ("gate:\n  sample_interval: .inf\n  routes:\n    chat: {upstream: 'http://127.0.0.1:1'}\n", "gate.sample_interval"),
        (
            "admission: {reject_if_queue_age_ms_gte: .nan}\ngate:\n  routes:\n    chat: {upstream: 'http://127.0.0.1:1'}\n",
            "admission.reject_if_queue_age_ms_gte",
        ),
    ],
)
def test_config_check_fails_on_nan_and_inf(tmp_path, text, key):
    """Row 10: `.nan`/`.inf` durations were accepted and `config check` said OK: ~900 reads a
    second against a backend, a backend that can never be hung, an unlimited budget."""
    path = tmp_path / "c.yml"
    path.write_text(text)
    r = cli("config", "check", str(path))
    assert r.returncode == 1 and key in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--api-key-file", "/nonexistent/key"),
        ("--rounds", "0"),
        ("--interval", "nan"),
        ("--kind", "gpu"),
        ("--no-such-flag",),
    ],
)
def test_check_cannot_run_is_never_hung(args):
    """Row 12: a missing --api-key-file, or --rounds 0, exited 1: "hung, restart warranted".
    A watchdog would restart a healthy server because of a typo. Now 4, "cannot run"."""
    r = cli("check", "http://127.0.0.1:9", *args)
    assert r.returncode == 4, (r.returncode, r.stderr)


async def test_a_partitioned_holder_is_told_before_another_can_claim(redis_url, tcp_proxy):
    """Row 1: with the holder's Redis connection black-holed, the heartbeat waited on a
    renewal with no deadline; a second holder got the GPU after the TTL while the first job
    ran on for seconds. Now the job is cancelled (LeaseLost) before the TTL can run out."""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    proxy = tcp_proxy(host, int(port))
    holder = LeaseClient.from_url(f"redis://127.0.0.1:{proxy.port}/0", ttl_ms=2000)
    other = LeaseClient.from_url(redis_url, ttl_ms=2000)
    events: dict[str, float] = {}
    try:
        asked = time.monotonic()
        lease = await holder.claim("g0", "worker-a")
        assert lease is not None
        expires_at = asked + 2.0  # the earliest the lease can expire in Redis

        async def job() -> None:
            proxy.blackhole()  # the holder's packets are dropped from now on, nothing is closed
            while True:
                await asyncio.sleep(0.01)

        async def second() -> None:
            got = await other.wait_for_gpu(Pool("p", ["g0"]), "worker-b", timeout=20)
            assert got is not None
            events["claimed"] = time.monotonic()

        claimer = asyncio.ensure_future(second())
        with pytest.raises(LeaseLost):
            await holder.run_leased(lease, job(), release=False)
        events["lost"] = time.monotonic()
        await asyncio.wait_for(claimer, 20)
        assert events["lost"] < expires_at <= events["claimed"], events
    finally:
        proxy.heal()
        await holder.aclose()
        await other.aclose()


async def test_fencing_tokens_never_go_back_when_redis_loses_its_data(own_redis_server):
    """Row 2: Redis restarted without persistence started the fencing tokens again at 1:
    a later holder could carry a smaller token than an earlier one."""
    client = LeaseClient.from_url(own_redis_server.url, ttl_ms=5000)
    try:
        tokens = []
        for _ in range(3):
            lease = await client.claim("g0", "w")
            assert lease is not None
            tokens.append(lease.token)
            await client.release(lease)
        own_redis_server.kill()  # no persistence: every key is gone
        own_redis_server.start()
        await client.redis.connection_pool.disconnect()
        lease = await client.claim("g0", "w")
        assert lease is not None
        tokens.append(lease.token)
        assert tokens == sorted(set(tokens)), tokens  # strictly increasing across the restart
    finally:
        await client.aclose()
