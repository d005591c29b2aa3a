"""Mutants of 'a heal is data, for the run's groups only': torchllm/ft/transport.py,
torchllm/ft/heal_codec.py, torchllm/ft/secret.py and the heal's dtype check
(scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_ft_heal_data.py::"
ROGUE = T + "test_a_rogue_answer_that_would_run_code_is_refused_and_runs_nothing"
NO_SECRET = T + "test_a_heal_request_without_the_secret_is_refused_in_one_line_on_both_sides"
NO_SECRET_START = T + "test_a_group_without_the_secret_does_not_start"
ROUND_TRIP = T + "test_a_trainers_state_goes_through_the_transport_and_back_equal"
BIND = T + "test_the_transport_listens_on_fault_tolerance_bind_only"
ACCEPTANCE = ("tests/test_fault_tolerance.py::"
              "test_a_killed_group_is_dropped_and_its_relaunch_heals_and_trains_in_step")

MUTANTS = [
    Mutant.at(
        "ft_heal_unpickled",
        "the healing group loads the peer's answer with torch.load(weights_only=False), as "
        "torchft's own transport does: whoever answers runs code in it",
        "torchllm.ft.transport:DataTransport._fetch",
        "            return decode(body)\n",
        "            import io\n            import torch\n"
        "            return torch.load(io.BytesIO(body), weights_only=False)\n",
        (ROGUE,),
    ),
    Mutant.at(
        "ft_heal_request_secret_not_checked",
        "the heal server serves whoever asks (the request's HMAC is not checked)",
        "torchllm.ft.transport:DataTransport._authentic",
        "        if not hmac.compare_digest(mac, request_mac(self._key, req.path, step, stamp, "
        "nonce)):\n            return False\n",
        "",
        (NO_SECRET,),
    ),
    Mutant.at(
        "ft_heal_answer_secret_not_checked",
        "the healing group loads any well-formed answer, without checking it carries the run's "
        "secret (a rogue server on the heal address injects weights)",
        "torchllm.ft.transport:DataTransport._fetch",
        "        if len(body) != int(size) or not hmac.compare_digest(\n"
        "                mac, answer_mac(self._key, nonce, step, body)):\n",
        "        if len(body) != int(size):\n",
        (ROGUE,),
    ),
    Mutant.at(
        "ft_heal_server_on_every_interface",
        "the heal server binds 0.0.0.0 whatever fault_tolerance.bind says",
        "torchllm.ft.transport:DataTransport.__init__",
        "        self._server = _server_class(bind)((bind, 0), Handler)\n",
        "        self._server = _server_class(bind)((\"0.0.0.0\", 0), Handler)\n",
        (BIND,),
    ),
    Mutant.at(
        "ft_no_secret_accepted",
        "a group without a shared secret starts (with an empty key anyone can compute)",
        "torchllm.ft.secret:load_secret",
        "    if len(secret) < MIN_LENGTH:\n",
        "    if False:\n",
        (NO_SECRET_START,),
    ),
    Mutant.at(
        "ft_heal_dtype_not_checked",
        "a heal's weights of another dtype are copied in silently (cast), not refused",
        "torchllm.ft.heal:_other_model",
        "        if tensor.dtype != theirs[name].dtype:\n",
        "        if False:\n",
        (ROUND_TRIP,),
    ),
    Mutant.at(
        "ft_heal_optimizer_shapes_not_checked",
        "a heal's optimizer state of other shapes is loaded (the step then fails far from it)",
        "torchllm.ft.heal:_other_optimizer",
        "and tuple(value.shape) != shape:",
        "and False:",
        (ROUND_TRIP,),
    ),
    Mutant.at(
        "ft_codec_sizes_not_checked",
        "a heal's tensor record is read without checking its size against its shape and the "
        "bytes received",
        "torchllm.ft.heal_codec:_tensor",
        "    if nbytes != math.prod(shape) * itemsize or offset + nbytes > len(data):\n",
        "    if False:\n",
        (T + "test_a_heal_whose_sizes_lie_is_refused",),
    ),
    Mutant(
        "ft_local_lighthouse_on_every_interface",
        "scripts/ft_local.sh's lighthouse binds every interface whatever fault_tolerance.bind says",
        "scripts/ft_local.sh",
        'torchft_lighthouse --min_replicas 1 --bind "$bind_host:$port"',
        'torchft_lighthouse --min_replicas 1 --bind "[::]:$port"',
        (ACCEPTANCE,),
    ),
    Mutant(
        "ft_local_new_secret_per_call",
        "scripts/ft_local.sh makes a new secret at every call: a relaunched group (its own call) "
        "cannot heal from the running ones",
        "scripts/ft_local.sh",
        '    [ -s "$secret_file" ] || new_secret\n',
        "    new_secret\n",
        (ACCEPTANCE,),
    ),
]
