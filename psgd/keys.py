"""`psgd keys DIR`: CurveZMQ key pairs for `security.curve = true`.

DIR/server.key, DIR/server.key_secret   the servers' pair (coordinator and shards)
DIR/client.key, DIR/client.key_secret   the clients' pair (workers, evaluator, daemons)
DIR/authorized/                         public keys the servers accept (client.key, server.key)

Copy the whole folder to machines that run servers; clients need server.key and their
own pair. Remove a key from authorized/ to lock its holder out: a server reads the folder
when it starts, so restart the servers (and the coordinator) after removing one.
"""
from __future__ import annotations

import os
import shutil

import zmq.auth


def make_keys(folder: str) -> str:
    """The pairs that `folder` lacks, each authorized as it is made: a pair made before is
    kept, and so is its absence from authorized/ (a key removed there stays locked out)."""
    os.makedirs(folder, exist_ok=True)
    auth = os.path.join(folder, "authorized")
    os.makedirs(auth, exist_ok=True)
    made = []
    for name in ("server", "client"):
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
    if not made:
        return f"{folder} holds both pairs already: nothing written (authorized clients in {auth})"
    pairs = f"the {' and '.join(made)} pair{'s' * (len(made) > 1)}"
    return f"keys written to {folder}: {pairs} (authorized clients in {auth})"
