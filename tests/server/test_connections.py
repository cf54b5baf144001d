"""Connections: slow clients are cut off after the request read timeout, and a
shutdown answers every in-flight request with an OpenAI-shaped error."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

READ_TIMEOUT = 1.0
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def _closed_by_server(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closes ``sock`` before ``deadline`` while we trickle bytes."""
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionError:
            return True
        try:
            sock.sendall(b"X")  # one more byte of a header that never ends
        except OSError:
            return True
    return False


def test_slow_clients_are_cut_off(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", request_read_timeout=READ_TIMEOUT)
    socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
    try:
        for i, sock in enumerate(socks):
            if i % 2:  # a whole head, then a body that trickles in
                sock.sendall(
                    HEAD + b"Content-Type: application/json\r\nContent-Length: 999\r\n\r\n{"
                )
            else:  # a head that trickles in
                sock.sendall(HEAD + b"X-Slow: ")
        # An idle connection that never sends anything is bounded too.
        socks.append(socket.create_connection(("127.0.0.1", srv.port)))
        t0 = time.monotonic()
        results: list[bool] = [False] * len(socks)

        def watch(i: int) -> None:
            results[i] = _closed_by_server(socks[i], t0 + READ_TIMEOUT + 10)

        threads = [threading.Thread(target=watch, args=(i,)) for i in range(len(socks))]
        for t in threads:
            t.start()
        # Meanwhile a client that is slow but within the timeout is served.
        with socket.create_connection(("127.0.0.1", srv.port)) as ok:
            body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
            ok.sendall(HEAD + b"Content-Type: application/json\r\n")
            time.sleep(READ_TIMEOUT / 3)
            ok.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert ok.recv(4096).startswith(b"HTTP/1.1 200")
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            assert c.get("/health").status_code == 200
        for t in threads:
            t.join(30)
        elapsed = time.monotonic() - t0
        assert all(results), results
        assert elapsed < READ_TIMEOUT + 10
    finally:
        for sock in socks:
            sock.close()


def test_keep_alive_connection_gets_the_timeout_again(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", request_read_timeout=READ_TIMEOUT)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        # The next request on the same connection trickles in (and keeps resetting
        # uvicorn's own keep-alive timer).
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        assert _closed_by_server(sock, t0 + READ_TIMEOUT + 10)
        assert time.monotonic() - t0 >= READ_TIMEOUT * 0.9
    # The clock stops once the request is in: a response may take longer.
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        body = {"prompt": "on and on", "max_tokens": 3500, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            t0 = time.monotonic()
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if time.monotonic() - t0 > 2 * READ_TIMEOUT:
                    break
            else:
                raise AssertionError("the stream ended early")
            assert events > 0
    srv.wait_idle()


def test_shutdown_answers_in_flight_requests(chat_model, server_factory) -> None:
    srv = server_factory(chat_model, served_model_name="tiny", graceful_shutdown_timeout=0.5)
    endless = {"prompt": "endless", "max_tokens": 3500, "ignore_eos": True}
    results: dict = {}
    streamed = threading.Event()

    def whole() -> None:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            results["whole"] = c.post("/v1/completions", json=endless)

    def stream() -> None:
        events = []
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            body = {**endless, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streamed.set()
        results["stream"] = events

    threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while srv.engine.stats()["requests_running"] < 2 or not streamed.is_set():
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.02)
    t0 = time.monotonic()
    srv.stop()
    stopped_in = time.monotonic() - t0
    for t in threads:
        t.join(30)

    r = results["whole"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "shutting down" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}

    events = results["stream"]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "engine_unavailable" and "shutting down" in err["message"]
    # Ended right after the grace period, not when the 3500 tokens were done.
    assert stopped_in < 10
