"""A least-connection reverse proxy on loopback that records every request it passes: the
balancer of the real-engine tests (vLLM and llama.cpp), and with one backend a recorder
that proves what a checker sent. Stdlib only."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable


class LeastConnProxy:
    """HTTP reverse proxy on loopback: each request goes to the backend with the fewest
    requests in flight (ties: round robin). Records (method, path) of every request,
    so a test can prove what a checker sent. With one backend it is a recorder.
    """

    def __init__(self, backends: list[str], port: int = 0) -> None:
        import http.server

        self.backends = list(backends)
        self.active = [0] * len(self.backends)
        self.sent_to = [0] * len(self.backends)
        self.requests: list[tuple[str, str, int]] = []  # (method, path, backend index)
        self._lock = threading.Lock()
        self._rr = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:  # quiet
                pass

            def _forward(self) -> None:
                import http.client
                from urllib.parse import urlsplit

                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                idx = proxy._pick()
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, idx))
                target = urlsplit(proxy.backends[idx])
                try:
                    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "keep-alive")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    conn.close()
                except OSError as e:
                    with contextlib.suppress(OSError):
                        msg = f"proxy: backend {proxy.backends[idx]}: {e}".encode()
                        self.send_response(502)
                        self.send_header("Content-Length", str(len(msg)))
                        self.end_headers()
                        self.wfile.write(msg)
                finally:
                    with proxy._lock:
                        proxy.active[idx] -= 1

            do_GET = do_POST = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="least-conn-proxy")
        self._thread.start()

    def _pick(self) -> int:
        with self._lock:
            n = len(self.backends)
            order = [(self._rr + i) % n for i in range(n)]
            idx = min(order, key=lambda i: self.active[i])
            self._rr = (idx + 1) % n
            self.active[idx] += 1
            self.sent_to[idx] += 1
            return idx

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, method: str | None = None, path_prefix: str = "") -> int:
        with self._lock:
            return sum(1 for m, p, _ in self.requests if (method is None or m == method) and p.startswith(path_prefix))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LeastConnProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def one_round_in(rec: LeastConnProxy, run: Callable[[], None], timeout: float = 60) -> threading.Thread:
    """``run`` (a checker reading through ``rec``) in a thread of its own, returned once its
    first /metrics read passed and a second more went by: the first round over (work in
    flight, progress unknown until the next). Fails unless exactly one read passed."""
    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while rec.count("GET", "/metrics") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.count("GET", "/metrics") == 1, rec.requests
    time.sleep(1.0)
    return t
