"""A loopback HTTP proxy in front of the moto S3 server that injects the faults object stores have:
connection resets mid-body, truncated bodies, flipped bytes, 503 SlowDown, a server gone for a while
(connections dropped unanswered, or refused: nothing listening).
It also counts the GETs of each object and the bytes they returned (downloads per node), and can pace
every body to one shared link rate (a node's network). Tests point AWS_ENDPOINT_URL at it in-process;
benchmarks run it in a process of its own (:class:`ProxyProcess`, ``python tests/s3_faults.py PORT``) so
that it shares no interpreter with the reader being measured, and read its counters over HTTP."""
from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """``FaultProxy(upstream_port)``; ``inject(kind, pattern, times)`` makes the next ``times`` GETs of keys
    matching ``pattern`` fail as ``kind`` ("reset", "truncate", "corrupt", "503"), or answer the whole object
    whatever byte range was asked ("norange": a server that ignores Range), or the next PUTs store only the
    first half of their body and answer 200 ("short", a gateway that loses bytes) or are held before their
    body is read, ``stalled`` set, until ``unstall`` is set ("stall"); a PUT whose client goes away mid-body
    is dropped, never forwarded, as a store keeps nothing of it; ``down(seconds)`` drops every
    connection for a while; ``refuse(seconds)`` stops listening for a while (a client's connect is refused,
    as from a host whose server is gone; open connections are dropped). ``gets[key]`` counts GETs of each
    object path that were answered, ``heads[key]`` the HEADs."""

    def __init__(self, upstream_port: int, rate: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.rate = rate  # bytes/s of the link all bodies share; 0: unpaced
        self._link_free = 0.0  # when the paced link is next idle
        self.rules: list[list] = []
        self.gets: Counter[str] = Counter()
        self.heads: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()  # body bytes of those GETs
        self.faults: Counter[str] = Counter()
        self.down_until = 0.0
        self.stalled, self.unstall = threading.Event(), threading.Event()  # a "stall" PUT held, and let go
        self.lock = threading.Lock()
        self._relisten: threading.Timer | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self._handler = Handler
        self.port = 0
        self._listen()

    def _listen(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)  # (SO_REUSEADDR: same port)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def refuse(self, seconds: float) -> None:
        """Nothing listens on the port for ``seconds`` (connects fail with ECONNREFUSED at once) and the
        connections open now are dropped at their next request; then it listens again on the same port."""
        with self.lock:
            if self._relisten is not None:
                raise RuntimeError("already refusing connections")
            self.down_until = time.monotonic() + seconds
            self.server.shutdown()
            self.server.server_close()
            self._relisten = threading.Timer(seconds, self._listen_again)
            self._relisten.daemon = True
            self._relisten.start()

    def _listen_again(self) -> None:
        with self.lock:
            if self._relisten is None:  # closed meanwhile
                return
            self._relisten = None
            self._listen()

    @property
    def refusing(self) -> bool:
        return self._relisten is not None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, kind: str, pattern: str, times: int = 1) -> None:
        with self.lock:
            self.rules.append([kind, re.compile(pattern), times])

    def down(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()
            self.gets.clear()
            self.heads.clear()
            self.bytes.clear()
            self.faults.clear()

    def _fault_for(self, method: str, path: str) -> str | None:
        if method not in ("GET", "PUT"):
            return None
        with self.lock:
            for rule in self.rules:
                if (rule[0] in ("short", "stall")) != (method == "PUT"):  # a PUT's faults, the others a GET's
                    continue
                if rule[2] > 0 and rule[1].search(path):
                    rule[2] -= 1
                    self.faults[rule[0]] += 1
                    return rule[0]
        return None

    def stats(self) -> dict:
        with self.lock:
            return {"gets": dict(self.gets), "heads": dict(self.heads), "bytes": dict(self.bytes)}

    def _control(self, h: BaseHTTPRequestHandler) -> None:
        """``/__proxy__/stats`` (the counters as JSON) and ``/__proxy__/clear``, for a proxy in another process."""
        if h.path.endswith("/clear"):
            self.clear()
        data = json.dumps(self.stats()).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _send(self, h: BaseHTTPRequestHandler, data: bytes) -> None:
        """The body, paced to the shared link when there is a rate: each 256 kB piece takes its turn."""
        if not self.rate:
            h.wfile.write(data)
            return
        view = memoryview(data)
        for k in range(0, len(view), 1 << 18):
            piece = view[k:k + (1 << 18)]
            with self.lock:
                done = max(time.monotonic(), self._link_free) + len(piece) / self.rate
                self._link_free = done
            time.sleep(max(0.0, done - time.monotonic()))
            h.wfile.write(piece)

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/__proxy__/"):
            self._control(h)
            return
        path = h.path.split("?", 1)[0]
        fault = self._fault_for(h.command, path) if h.command == "PUT" else None
        body = None
        if h.command in ("PUT", "POST"):
            if fault == "stall":  # the client blocks sending its body until the test lets it go
                self.stalled.set()
                self.unstall.wait(60)
            expected = int(h.headers.get("Content-Length") or 0)
            try:
                body = h.rfile.read(expected)
            except OSError:
                body = b""
            if len(body) < expected:  # the client went away mid-body: a store keeps nothing of it
                _drop(h)
                return
        if time.monotonic() < self.down_until:  # the server is gone: the connection drops without an answer
            _drop(h)
            return
        if h.command != "PUT":
            fault = self._fault_for(h.command, path)
        if fault == "503":
            h.send_response(503)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(SLOWDOWN)))
            h.end_headers()
            h.wfile.write(SLOWDOWN)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        drop = ("connection", "range") if fault == "norange" else ("connection",)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in drop}
        if fault == "short":  # a gateway that loses the body's second half and says nothing
            body = body[: len(body) // 2]
            headers = {k: v for k, v in headers.items()  # (nor any checksum of the whole)
                       if k.lower() not in ("content-length", "content-md5") and "checksum" not in k.lower()}
            headers["Content-Length"] = str(len(body))
        conn.request(h.command, h.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if h.command == "GET" and resp.status in (200, 206) and "list-type" not in h.path:
            with self.lock:
                self.gets[path] += 1
                self.bytes[path] += len(data)
        if h.command == "HEAD":
            with self.lock:
                self.heads[path] += 1
        if fault == "corrupt" and data:
            data = bytearray(data)
            data[len(data) // 2] ^= 0xFF
            data = bytes(data)
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                h.send_header(k, v)
        length = resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data))
        h.send_header("Content-Length", length)
        h.end_headers()
        if h.command == "HEAD":
            return
        if fault in ("reset", "truncate"):  # half the body, then the connection goes away
            self._send(h, data[: len(data) // 2])
            h.wfile.flush()
            if fault == "reset":  # closed with SO_LINGER 0: the client reads a TCP reset
                h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                h.close_connection = True
            else:
                _drop(h)
            return
        self._send(h, data)

    def close(self) -> None:
        with self.lock:
            if self._relisten is not None:  # not listening: nothing to shut down
                self._relisten.cancel()
                self._relisten = None
                return
        self.server.shutdown()
        self.server.server_close()


def _drop(h: BaseHTTPRequestHandler) -> None:
    h.close_connection = True
    try:
        h.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class ProxyProcess:
    """A :class:`FaultProxy` (no faults) in a process of its own in front of ``upstream_port``, paced to
    ``rate`` bytes/s when given; ``endpoint``, ``stats()`` / ``bytes()`` (summed over the objects) and
    ``close()``."""

    def __init__(self, upstream_port: int, rate: float = 0.0) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, str(upstream_port), "--rate", str(rate)],
                                        stdout=subprocess.PIPE, text=True)
        self.port = int(self.process.stdout.readline())  # the child prints its port once it listens

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self, clear: bool = False) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/__proxy__/clear" if clear else "/__proxy__/stats")
        out = json.loads(conn.getresponse().read())
        conn.close()
        return out

    def bytes(self) -> int:
        return sum(self.stats()["bytes"].values())

    def close(self) -> None:
        self.process.terminate()
        self.process.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description="the loopback S3 proxy in its own process (prints its port)")
    ap.add_argument("upstream_port", type=int)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes/s of the shared link (0: unpaced)")
    args = ap.parse_args()
    proxy = FaultProxy(args.upstream_port, args.rate)
    print(proxy.port, flush=True)
    proxy.thread.join()


if __name__ == "__main__":
    main()
