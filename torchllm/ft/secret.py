"""The run's shared secret: the key a group proves itself with before a peer serves it a heal,
and that authenticates the heal it receives (torchllm/ft/transport.py).

From the file `fault_tolerance.secret_file` names, else from the environment variable
`fault_tolerance.secret_env` (default TORCHLLM_FT_SECRET). scripts/ft_local.sh makes one per
run; on several machines every group's launch sets the same one, e.g.
`export TORCHLLM_FT_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')`.
"""

from __future__ import annotations

import stat
from pathlib import Path

from torchllm.config.job_config import ConfigError

MIN_LENGTH = 16
MAX_FILE_BYTES = 4096


def load_secret(ftcfg, environ) -> bytes:
    """The secret's bytes; ConfigError (one line, naming the variable or file) without one."""
    make = ("python -c 'import secrets; print(secrets.token_hex(32))'")
    if ftcfg.secret_file:
        path = Path(ftcfg.secret_file)
        try:
            info = path.stat()
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
                raise ConfigError(f"fault_tolerance.secret_file = {path}: not a file of at most "
                                  f"{MAX_FILE_BYTES} bytes", "fault_tolerance.secret_file")
            if info.st_mode & 0o077:
                raise ConfigError(f"fault_tolerance.secret_file = {path} is readable by others "
                                  f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 it",
                                  "fault_tolerance.secret_file")
            secret, where = path.read_text().strip(), f"fault_tolerance.secret_file = {path}"
        except OSError as e:
            raise ConfigError(f"fault_tolerance.secret_file = {path}: {e.strerror or e}",
                              "fault_tolerance.secret_file") from None
        key = "fault_tolerance.secret_file"
    else:
        name = ftcfg.secret_env
        secret, where = environ.get(name, "").strip(), f"${name} (fault_tolerance.secret_env)"
        key = "fault_tolerance.secret_env"
    if len(secret) < MIN_LENGTH:
        raise ConfigError(
            f"fault_tolerance.enable needs the run's shared secret, at least {MIN_LENGTH} "
            f"characters, the same in every group: {where} is "
            f"{'empty' if not secret else f'{len(secret)} characters'}; scripts/ft_local.sh makes "
            f"one per run, else set it in every group's launch (`export {ftcfg.secret_env}=$("
            f"{make})`)", key)
    return secret.encode()
