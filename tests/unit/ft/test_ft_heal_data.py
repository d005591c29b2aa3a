"""A heal is data, for the run's groups only (torchllm/ft/transport.py, docs/fault_tolerance.md).

In-process, over real sockets on loopback: an answer that would run code (a pickle) is refused and
runs nothing; a request or an answer without the run's shared secret is refused in one line on
both sides; a real trainer's state goes through the transport and back equal; the transport
listens on fault_tolerance.bind only; a group without a secret does not start.
"""

from __future__ import annotations

import http.server
import io
import os
import pickle
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from conftest import tiny_args
from messages import assert_names, raises_naming, refused
from torchllm.config import ConfigError, load_config
from builders.ft import listening, log_lines  # noqa: F401 (log_lines: a fixture)

pytest.importorskip("torchft")

KEY = b"0123456789abcdef0123456789abcdef"
TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def transports():
    from torchllm.ft.transport import data_transport

    made = []

    def make(key=KEY, bind="127.0.0.1"):
        made.append(data_transport(bind, key, TIMEOUT))
        return made[-1]

    yield make
    for t in made:
        t.shutdown()


def serve(answer: bytes, key: bytes | None = None) -> tuple[str, http.server.HTTPServer]:
    """A server answering every GET with `answer` (signed with `key`, if given, as a peer with
    the run's secret signs): its heal address."""
    from torchllm.ft.transport import HEADER, answer_mac

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            if key is not None:
                step = int(self.path.rsplit("/", 1)[1])
                self.send_header(HEADER + "Auth",
                                 answer_mac(key, self.headers[HEADER + "Nonce"], step, answer))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/heal/", server


class RunsCode:
    """Unpickling this runs a shell command (creates the marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def one_line(text: str) -> str:
    assert "\n" not in text and "Traceback" not in text, text
    return text


# -- (1) an answer that would run code ------------------------------------------------------

def test_a_rogue_answer_that_would_run_code_is_refused_and_runs_nothing(tmp_path, transports):
    from torch.distributed._serialization import _streaming_save

    from torchllm.ft.heal_codec import encode
    from torchllm.ft.transport import HealRefused

    marker = tmp_path / "ran"
    payload = pickle.dumps({"user": RunsCode(marker)})
    stream = io.BytesIO()  # as torchft's HTTPTransport sends a state (and unpickles it)
    _streaming_save({"user": RunsCode(marker)}, stream)
    receiver = transports()
    # A rogue answering on the heal address: pickles, then a well-formed heal, none with the
    # run's secret; then an insider (who has the secret) answering pickles.
    forged = encode({"user": {"torchllm": {"model": {"w": torch.ones(2)}}}, "torchft": {}})
    for body, key in ((payload, None), (stream.getvalue(), None), (forged, None),
                      (payload, KEY), (stream.getvalue(), KEY)):
        address, server = serve(body, key)
        try:
            with raises_naming(HealRefused, address.split("/heal/")[0]) as e:
                receiver.recv_checkpoint(0, address, 7, TIMEOUT)
        finally:
            server.shutdown()
            server.server_close()
        one_line(str(e.value))
        assert receiver.refusal == str(e.value)
        if key is None:
            assert_names(e.value, "secret")
        assert not marker.exists(), "the peer's answer ran code in the healing group"


# -- (2) a request without the run's secret --------------------------------------------------

def test_a_heal_request_without_the_secret_is_refused_in_one_line_on_both_sides(
        transports, log_lines):
    from torchllm.ft.transport import HealRefused

    server = transports()
    server.send_checkpoint([1], 3, {"user": {"w": torch.arange(4.0)}, "torchft": {"step": 3}},
                           TIMEOUT)
    where = server.metadata().split("/heal/")[0]
    stranger = transports(key=b"another-secret-of-32-bytes-long!")
    with raises_naming(HealRefused, where, "secret"):
        stranger.recv_checkpoint(0, server.metadata(), 3, TIMEOUT)
    assert_names(one_line(stranger.refusal), where, "secret")
    # A bare request (no secret at all) is refused too, and nothing of the state is sent.
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.metadata() + "3", timeout=10)
    assert e.value.code == 403 and b"arange" not in e.value.read()
    refusals = [line for line in log_lines if "refused a heal request" in line]
    assert len(refusals) == 2, log_lines
    for line in refusals:
        assert_names(one_line(line), "127.0.0.1", "secret")
    # A peer with the secret is served (the refusals were about the secret).
    peer = transports()
    assert torch.equal(peer.recv_checkpoint(0, server.metadata(), 3, TIMEOUT)["user"]["w"],
                       torch.arange(4.0))


def test_a_group_without_the_secret_does_not_start(tmp_path):
    from cli import run_train

    with socket.socket() as house:  # something answers at the lighthouse's address
        house.bind(("127.0.0.1", 0))
        house.listen()
        env = {k: v for k, v in os.environ.items() if k != "TORCHLLM_FT_SECRET"}
        env["TORCHFT_LIGHTHOUSE"] = f"http://localhost:{house.getsockname()[1]}"
        ran = run_train(*tiny_args(tmp_path, "--fault_tolerance.enable"), env=env)
    refused(ran, "TORCHLLM_FT_SECRET", "fault_tolerance.secret_env")


# -- (3) a real state, through the transport and back ----------------------------------------

def _equal(a, b, path="state"):
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path


def test_a_trainers_state_goes_through_the_transport_and_back_equal(tmp_path, transports):
    from torchllm.ft import HealState
    from torchllm.train import Trainer

    args = ["--data.tokenizer=bytes", "--checkpoint.enable=false", "--validation.enable=false",
            "--eval.sample_freq=0", "--training.steps=4"]
    live = Trainer(load_config(tiny_args(tmp_path / "a", *args)))
    fresh = Trainer(load_config(tiny_args(tmp_path / "b", *args)))

    def heal_of(t):
        return HealState(t.state, lambda: None)  # the trainer's one training state

    try:
        for _ in range(2):
            live.train_state.step += 1
            live.train_step()
        sent = {"user": {"torchllm": heal_of(live).state_dict()},
                "torchft": {"step": 2, "batches_committed": 2}}
        server, receiver = transports(), transports()
        server.send_checkpoint([1], 2, sent, TIMEOUT)
        got = receiver.recv_checkpoint(0, server.metadata(), 2, TIMEOUT)
        _equal(sent, got)
        heal_of(fresh).load_state_dict(got["user"]["torchllm"])
        assert fresh.step == 2
        _equal(live.model.state_dict(), fresh.model.state_dict())
        # The receiver's own tensors are the template: another dtype is refused, naming it.
        name = next(iter(got["user"]["torchllm"]["model"]))
        got["user"]["torchllm"]["model"][name] = got["user"]["torchllm"]["model"][name].double()
        with raises_naming(ConfigError, name, "float64"):
            heal_of(fresh).load_state_dict(got["user"]["torchllm"])
        got["user"]["torchllm"]["model"][name] = sent["user"]["torchllm"]["model"][name]
        state = got["user"]["torchllm"]["optimizer"][0]["state"]
        index = next(iter(state))
        moment = next(k for k, v in state[index].items() if v.dim() > 0)
        state[index][moment] = state[index][moment].reshape(-1)[:3]
        with raises_naming(ConfigError, moment, f"parameter {index}", "[3]"):
            heal_of(fresh).load_state_dict(got["user"]["torchllm"])
    finally:
        live.close()
        fresh.close()


# -- (4) the address it listens on -----------------------------------------------------------


def test_the_transport_listens_on_fault_tolerance_bind_only(tmp_path, transports):
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp here")
    cfg = load_config(tiny_args(tmp_path, "--fault_tolerance.enable"))
    assert cfg.fault_tolerance.bind == "127.0.0.1"  # one machine: loopback by default
    t = transports(bind=cfg.fault_tolerance.bind)
    port = t._server.server_address[1]
    assert listening(port) == ["0100007F"]  # 127.0.0.1, and nothing else
    assert t.metadata() == f"http://127.0.0.1:{port}/heal/"
    with raises_naming(ConfigError, "fault_tolerance.bind", "localhost",
                       key="fault_tolerance.bind"):
        load_config(tiny_args(tmp_path, "--fault_tolerance.enable",
                              "--fault_tolerance.bind=localhost"))


def test_a_heal_whose_sizes_lie_is_refused():
    from torchllm.ft.heal_codec import MAGIC, decode, encode

    blob = encode({"w": torch.arange(6.0).reshape(2, 3)})
    size = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "big")
    header = blob[len(MAGIC) + 8:len(MAGIC) + 8 + size]
    for lie in (b'"shape": [2, 3]', b'"shape": [200, 3]'), (b'"shape": [2, 3]', b'"shape": [3, 3]'):
        bad_header = header.replace(*lie)
        bad = MAGIC + len(bad_header).to_bytes(8, "big") + bad_header + blob[-24:]
        with raises_naming(ValueError, "tensor 0"):
            decode(bad)
    with raises_naming(ValueError, "heal"):
        decode(pickle.dumps({"w": 1}))


@pytest.mark.slow
def test_a_relaunched_group_with_another_secret_is_refused_on_both_sides(tmp_path):
    """Through scripts/ft_local.sh: group 0 trains; group 1 relaunched with another secret asks
    it for a heal, is refused (exit 2, one line naming the address and the secret), and group 0
    logs one line naming the peer and trains on."""
    import re
    import signal
    import subprocess

    from conftest import REPO, wait_for
    from builders.ft import free_port, steps_of

    logs = tmp_path / "logs"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{free_port()}",
           "FT_LOG_DIR": str(logs), "TORCHLLM_FORK_WORKERS": "1",
           "FT_LIGHTHOUSE_RECORDS": str(tmp_path / "records")}
    for k in ("FT_HEARTBEAT_TIMEOUT_MS", "FT_JOIN_TIMEOUT_MS", "TORCHLLM_FT_SECRET"):
        env.pop(k, None)
    args = tiny_args(tmp_path, "--training.steps=200", "--data.tokenizer=bytes",
                     "--validation.enable=false", "--eval.sample_freq=0",
                     "--checkpoint.interval=1000")
    script = [str(REPO / "scripts" / "ft_local.sh"), "2", *args]
    first = subprocess.Popen(script, cwd=REPO, env={**env, "FT_REPLICAS": "0"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_for(lambda: 2 in steps_of(logs / "replica_0.log"), 300, what="group 0 at step 2")
        other = {**env, "FT_REPLICAS": "1", "FT_LOG_DIR": str(tmp_path / "logs1"),
                 "TORCHLLM_FT_SECRET": "not-the-secret-of-this-run-at-all"}
        second = subprocess.run(script, cwd=REPO, env=other, capture_output=True, timeout=300)
        log1 = (tmp_path / "logs1" / "replica_1.log").read_text(errors="replace")
        assert second.returncode == 2 and "Traceback" not in log1, log1[-3000:]
        lines = [line for line in log1.splitlines() if "secret" in line and "refused" in line]
        address = re.search(r"http://[^ ]+:\d+", lines[0])[0] if lines else ""
        assert len(lines) == 1 and address, log1[-3000:]
        before = max(steps_of(logs / "replica_0.log"))
        wait_for(lambda: max(steps_of(logs / "replica_0.log")) > before + 1, 300,
                 what="group 0 training on after the refusal")
        log0 = (logs / "replica_0.log").read_text(errors="replace")
        refusals = [line for line in log0.splitlines() if "refused a heal request" in line]
        assert len(refusals) >= 1 and all("127.0.0.1" in line and "secret" in line
                                          for line in refusals), log0[-3000:]
        # (torchft logs the all-reduce group 1's exit broke as a dead peer's, with a traceback)
    finally:  # group 0 (a process group of its own), then ft_local.sh and its lighthouse
        if (logs / "replica_0.pid").exists():
            os.killpg(int((logs / "replica_0.pid").read_text()), signal.SIGKILL)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
