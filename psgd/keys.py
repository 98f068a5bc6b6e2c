"""`psgd keys DIR`: CurveZMQ key pairs for `security.curve = true`.

DIR/server.key, DIR/server.key_secret   the servers' pair (coordinator and shards)
DIR/client.key, DIR/client.key_secret   the clients' pair (workers, evaluator, daemons)
DIR/authorized/                         public keys the servers accept (client.key, server.key)

Copy the whole folder to machines that run servers; clients need server.key and their
own pair (`psgd keys DIR` in a client's folder makes its own pair and keeps the servers'
server.key; that pair's client.key then goes into the servers' authorized/, and the
servers are restarted). Remove a key from authorized/ to lock its holder out: a server reads the folder
when it starts, so restart the servers (and the coordinator) after removing one.
"""
from __future__ import annotations

import os
import shutil

import zmq.auth

from .config import ConfigError


def make_keys(folder: str) -> str:
    """The pairs that `folder` lacks, each authorized as it is made: a pair made before is
    kept, and so is its absence from authorized/ (a key removed there stays locked out).
    A public key there without its secret is another machine's (a client's folder holds
    the servers' server.key alone): it is kept too, not replaced by a new pair's, which no
    server would answer to."""
    alone = [f"{name}.key" for name in ("server", "client")
             if os.path.exists(os.path.join(folder, f"{name}.key"))
             and not os.path.exists(os.path.join(folder, f"{name}.key_secret"))]
    for key in alone:   # (checked before anything is made)
        _check_kept(os.path.join(folder, key))
    os.makedirs(folder, exist_ok=True)
    auth = os.path.join(folder, "authorized")
    os.makedirs(auth, exist_ok=True)
    made = []
    for name in ("server", "client"):
        if f"{name}.key" in alone:
            continue
        if not os.path.exists(os.path.join(folder, f"{name}.key_secret")):
            made.append(name)
            mask = os.umask(0o077)   # the secret key is never readable by others, not even while written
            try:
                zmq.auth.create_certificates(folder, name)
            finally:
                os.umask(mask)
            os.chmod(os.path.join(folder, f"{name}.key"), 0o644)   # a public key is for sharing
        os.chmod(os.path.join(folder, f"{name}.key_secret"), 0o600)
    for name in made:  # daemons talk to the coordinator as clients with either pair
        shutil.copy(os.path.join(folder, f"{name}.key"), os.path.join(auth, f"{name}.key"))
    kept = (f"; {' and '.join(alone)} kept: a public key without its secret is another machine's (a new pair "
            f"would not be the one its holder uses)" if alone else "")
    if "server.key" in alone and "client" in made:   # (the servers know only the pairs in their authorized/)
        kept += (f"; copy {os.path.join(folder, 'client.key')} into the servers' authorized/ folder and restart "
                 f"them: until then they do not answer this pair")
    if not made:
        if alone:
            return f"{folder}: nothing written{kept}"
        return f"{folder} holds both pairs already: nothing written (authorized clients in {auth})"
    from .transport import forget_socket_keys
    forget_socket_keys()   # (a socket of this process made later loads the new pairs)
    pairs = f"the {' and '.join(made)} pair{'s' * (len(made) > 1)}"
    return f"keys written to {folder}: {pairs} (authorized clients in {auth}){kept}"


def _check_kept(path: str) -> None:
    """A public key kept as another machine's (the servers' server.key in a client's
    folder) that is no CurveZMQ key: refused here, where `psgd keys` said "kept" of it and
    every job with the folder failed at its first connection."""
    try:
        zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"psgd keys: {path} is not a CurveZMQ public key ({e}): copy the servers' "
                          f"{os.path.basename(path)} there again, or remove it to make a new pair") from None
