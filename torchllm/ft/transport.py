"""How a live replica group's state reaches a group that heals from it: data, and only for the run.

torchft's own HTTP transport serves a group's state on every interface to anyone who asks, and
the receiver unpickles what it gets (`torch.load(weights_only=False)`): whoever answers on the
heal address runs code in the group that heals. This transport (torchft's `CheckpointTransport`)
instead

- listens on `fault_tolerance.bind` only (loopback by default);
- serves a heal only to a peer that presents the run's shared secret: an HMAC-SHA256 over the
  request (path, step, time, nonce) with the key of `fault_tolerance.secret_env` or
  `fault_tolerance.secret_file` (torchllm/ft/secret.py); a request without it is refused in one
  line on both sides;
- authenticates its answer (an HMAC over the request's nonce, the step and the body): an answer
  without it is refused before a byte of it is read as state;
- sends the state as data (torchllm/ft/heal_codec.py): tensors as raw bytes with their dtype
  and shape, the rest as JSON; nothing is unpickled. HealState.load_state_dict then checks the
  names, shapes and dtypes against the receiver's own tensors.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import ipaddress
import logging
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request

from torchllm.ft.heal_codec import decode, encode
from torchllm.log import logger

MAX_SKEW_S = 300  # a request's time may differ this much from the server's clock
REFUSED = 403
HEADER = "X-Torchllm-Heal-"


class HealRefused(Exception):
    """A heal this group will not load (no shared secret, a foreign answer): one line."""


def request_mac(key: bytes, path: str, step: int, stamp: str, nonce: str) -> str:
    return hmac.new(key, f"heal\n{path}\n{step}\n{stamp}\n{nonce}".encode(),
                    hashlib.sha256).hexdigest()


def answer_mac(key: bytes, nonce: str, step: int, body: bytes) -> str:
    mac = hmac.new(key, f"answer\n{nonce}\n{step}\n".encode(), hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def advertised_host(bind: str) -> str:
    """The host a peer reaches this group's transport at: the bound address itself, or this
    machine's name when it listens on every interface."""
    ip = ipaddress.ip_address(bind)
    host = socket.gethostname() if ip.is_unspecified else bind
    return f"[{host}]" if ":" in host else host


def _server_class(bind: str):
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET

    class Server(http.server.ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    return Server


class DataTransport:
    """torchft CheckpointTransport: see the module doc. `sent_to`: the quorum ranks that healed
    from this group since the last look (ReplicaGroups names them); `refusal`: the one line of
    a heal this group refused (ReplicaGroups stops with it)."""

    def __init__(self, bind: str, key: bytes, timeout):
        self.bind, self._key, self._timeout = bind, key, timeout.total_seconds()
        self.sent_to: list = []
        self.refusal: str | None = None
        self._served: tuple[int, bytes] | None = None  # (step, encoded state) while allowed
        self._cond = threading.Condition()
        self._seen: dict[str, float] = {}  # nonces of accepted requests (no replays)
        transport = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = self._timeout

            def do_GET(self):
                transport._answer(self)

            def log_message(self, *args):  # no line per request
                pass

        self._server = _server_class(bind)((bind, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="torchllm-heal-server")
        self._thread.start()

    # -- torchft's CheckpointTransport ------------------------------------------------------

    def metadata(self) -> str:
        port = self._server.server_address[1]
        return f"http://{advertised_host(self.bind)}:{port}/heal/"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout) -> None:
        self.sent_to = list(dst_ranks)
        blob = encode(state_dict)  # a copy: the live state may change once disallowed
        with self._cond:
            self._served = (step, blob)
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._served = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout):
        try:
            return self._fetch(metadata, step, timeout.total_seconds())
        except HealRefused as e:
            self.refusal = str(e)  # ReplicaGroups stops with it (one line, exit 2)
            raise

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    # -- the client -------------------------------------------------------------------------

    def _fetch(self, base: str, step: int, timeout_s: float):
        if not base.startswith("http://") or "/heal/" not in base:
            raise HealRefused(f"fault tolerance: a heal from {base!r} refused: not this "
                              "transport's address (http://HOST:PORT/heal/)")
        url = f"{base}{step}"
        where = base.split("/heal/")[0]
        path = url[len(where):]
        stamp, nonce = str(int(time.time())), secrets.token_hex(16)
        request = urllib.request.Request(url, headers={
            HEADER + "Time": stamp, HEADER + "Nonce": nonce,
            HEADER + "Auth": request_mac(self._key, path, step, stamp, nonce)})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                size = answer.headers.get("Content-Length")
                mac = answer.headers.get(HEADER + "Auth", "")
                if size is None or not size.isdigit():
                    raise HealRefused(f"fault tolerance: the heal from {where} refused: its "
                                      "answer has no Content-Length")
                body = answer.read(int(size))
        except urllib.error.HTTPError as e:
            if e.code == REFUSED:
                raise HealRefused(
                    f"fault tolerance: the heal from {where} was refused by the peer: it did not "
                    "accept this group's shared secret (every group of a run needs the same "
                    "one: fault_tolerance.secret_env / secret_file)") from None
            raise RuntimeError(f"fault tolerance: the heal from {where} failed: HTTP {e.code} "
                               f"{e.reason}") from None
        if len(body) != int(size) or not hmac.compare_digest(
                mac, answer_mac(self._key, nonce, step, body)):
            raise HealRefused(
                f"fault tolerance: the heal from {where} refused: its answer does not carry this "
                "run's shared secret (fault_tolerance.secret_env / secret_file); nothing of it "
                "was loaded")
        try:
            return decode(body)
        except ValueError as e:
            raise HealRefused(f"fault tolerance: the heal from {where} refused: {e}") from None

    # -- the server -------------------------------------------------------------------------

    def _answer(self, req) -> None:
        peer = req.client_address[0]
        parts = req.path.split("/")
        step = int(parts[2]) if len(parts) == 3 and parts[1] == "heal" and \
            parts[2].isdigit() else None
        if step is None:
            req.send_error(404, "not a heal address")
            return
        if not self._authentic(req, step):
            logger.warning("fault tolerance: refused a heal request from %s: it does not carry "
                           "this run's shared secret (fault_tolerance.secret_env / secret_file)",
                           peer)
            req.send_error(REFUSED, "this run's shared secret is required")
            return
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._served is not None and self._served[0] == step, self._timeout)
            served = self._served
        if not ready:
            req.send_error(404, f"no heal of step {step} served here")
            return
        body = served[1]
        req.send_response(200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(len(body)))
        req.send_header(HEADER + "Auth",
                        answer_mac(self._key, req.headers[HEADER + "Nonce"], step, body))
        req.end_headers()
        req.wfile.write(body)

    def _authentic(self, req, step: int) -> bool:
        stamp, nonce = req.headers.get(HEADER + "Time", ""), req.headers.get(HEADER + "Nonce", "")
        mac = req.headers.get(HEADER + "Auth", "")
        if not stamp.isdigit() or abs(time.time() - int(stamp)) > MAX_SKEW_S or not nonce:
            return False
        if not hmac.compare_digest(mac, request_mac(self._key, req.path, step, stamp, nonce)):
            return False
        with self._cond:
            now = time.time()
            self._seen = {n: t for n, t in self._seen.items() if now - t < 2 * MAX_SKEW_S}
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
        return True


def data_transport(bind: str, key: bytes, timeout) -> DataTransport:
    """A DataTransport that is also a torchft CheckpointTransport (torchft imported lazily)."""
    from torchft.checkpointing import CheckpointTransport

    class Transport(DataTransport, CheckpointTransport):
        pass

    return Transport(bind, key, timeout)


class DropRefusalTraces(logging.Filter):
    """torchft logs a failed heal with its traceback; a refusal already said its one line."""

    def filter(self, record) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))
