"""Sockets and request/reply over ZeroMQ; knows frames, deadlines and handlers, not
what an op means, tensors or modes.

- `server_socket`: a ROUTER bound to an address (CurveZMQ server when security is on).
- `Service`: the one ROUTER serve loop of every daemon (shard server, coordinator):
  decode, dispatch by op to a handler table, reply; errors become error replies that
  carry the request's id, and the loop goes on.
- `Peers`: one DEALER per peer; requests to all peers are in flight at once and replies
  are matched by request id, so a late answer from one peer blocks no one else. Every
  wait has a deadline; `PeerTimeout` names the address that did not answer, and
  `HandshakeFailed` one that refused this client's CurveZMQ handshake.

Security (CurveZMQ): `psgd keys DIR` writes DIR/server.key(_secret) and
DIR/client.key(_secret), and DIR/authorized/ holds the public keys that servers accept.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import zmq

from . import lane as lanes
from . import wire
from .config import ConfigError, SecurityConfig, tcp_parts
from .log import log
from .metrics import OutputError, fd_limit
from .spinning import Spinner

try:
    import resource
except ImportError:   # (not a POSIX system)
    resource = None  # type: ignore[assignment]

LOOPBACK = ("127.", "localhost", "[::1]")


class PeerTimeout(TimeoutError):
    def __init__(self, address: str, waited: float, what: str):
        super().__init__(f"no answer from {address} after {waited:.0f} s ({what})")
        self.address = address
        self.partial: dict = {}


class HandshakeFailed(ConnectionError):
    """A peer refused the connection's security handshake (a CurveZMQ key it does not
    accept, or one side without CurveZMQ): no wait makes it answer, so it is not a
    `PeerTimeout`."""


# The client sockets' monitors report these (pyzmq's enums as plain ints): a handshake
# that succeeded, and the two failures that are a refusal (a connection dropped during its
# greeting, a peer restarting, is none: ZeroMQ says NO_DETAIL, and tries again)
_AUTH, _PROTOCOL, _SUCCEEDED = (int(zmq.EVENT_HANDSHAKE_FAILED_AUTH), int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
                                int(zmq.EVENT_HANDSHAKE_SUCCEEDED))
_MECHANISM_MISMATCH = int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
_ACCEPTED, _DISCONNECTED, _SRCFD = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED), int(zmq.SRCFD)   # (`watch`)
_monitors = itertools.count(1)   # each monitor's own inproc name (pyzmq's default reuses a closed socket's fd)
# How often a waiting client reads its monitors' events (Peers.wait): one left unread
# blocks ZeroMQ's I/O thread, and every socket of the process, once it holds about a
# thousand (a socket that handshook that often: its peer restarting, its connection dropped
# and made again); a handshake takes a reconnect interval (100 ms), so about 10 come a second.
MONITOR_READ_S = 1.0


def handshake_failure(event: int, value: int) -> str:
    """What a failed handshake (a monitor's event and value) means for psgd's user; ''
    for any other event."""
    if event == _AUTH:
        return ("the server refused this client's CurveZMQ key: is the client's public key in the server's "
                "security.keys/authorized/? (a server reads it when it starts)")
    if event == _PROTOCOL and value == _MECHANISM_MISMATCH:
        return "one side uses CurveZMQ and the other does not: set security.curve the same everywhere"
    return ""


# Frames below this many bytes are copied at send (pyzmq's copy_threshold, 64 KiB by
# default); larger ones go without a copy. A zero-copy frame costs pyzmq ~25 us more
# to send (and wakes its garbage-collector thread for the GIL when ZeroMQ is done with
# it); copying 256 KiB costs about that.
COPY_THRESHOLD = 256 << 10
# A Service forgets the trackers of frames ZeroMQ is done with when asked (`in_flight`), and
# whenever it holds twice as many as were still in flight at its last look, or this many
# (`Service.send`): a daemon that never asks (a shard whose tables do not change: ltfb's)
# kept every one, about 2 KB per large reply, for its whole run.
PRUNE_TRACKERS = 64
# Large replies (zero-copy frames, each holding what it lends: a shard's tables of its
# revision) a Service keeps for one peer while ZeroMQ has not sent them (the peer does not
# read its answers); past this many, a reply to that peer is dropped and counted as a bad
# message. An honest peer has a request or two in flight a server and reads its answers;
# ZeroMQ's own bound is its high-water mark, 1,000 messages a connection, so a peer that
# never read pinned up to 1,000 versions of the tables a connection (52 KB tables: +250 MB
# a shard for five connections; 40 MB tables: 40 GB a connection). Small replies (error
# replies, copied at send) are not bounded here: a flood that reads gets every answer.
MAX_UNREAD_REPLIES = 16
# ... and ZeroMQ's own bound on the replies of any size a server queues for one peer (its
# send high-water mark, per connection; past it, ZeroMQ drops that peer's replies): its
# default, 1,000, let a peer that never read hold 1,000 copies of a shard's replies below
# COPY_THRESHOLD a connection (52 KB tables, copied at send: 52 MB). 128 leaves a flood of
# requests that does read room for every answer, on a busy machine too.
SERVER_SNDHWM = 128
# How long a server gives a connection to finish its handshake (ZeroMQ's ZMQ_HANDSHAKE_IVL)
# before it drops it. Each connection holds one of the daemon's file descriptors; one that
# sends nothing, a partial greeting, or a CurveZMQ handshake without the job's keys held it
# for ZeroMQ's default, 30 s: 1,000 of them from anyone who reaches the port left a daemon
# under `ulimit -n` 1024 without descriptors (see `raise_fd_limit`, `Service`). An honest
# handshake takes milliseconds (a CurveZMQ one a ZAP answer from the daemon's
# authenticator thread too).
SERVER_HANDSHAKE_S = 10.0
# The soft limit on open files that a daemon raises its own to (`raise_fd_limit`), where its
# hard limit allows: enough for tens of thousands of peers, and not a hard limit of 2^30
# (some containers) that code closing every possible descriptor would walk.
FD_LIMIT = 1 << 16
# A client's send on a same-host lane waits at most this long for room (its daemon is not
# reading: stopped, or far behind); then the lane is closed and the request goes over ZeroMQ.
LANE_SEND_S = 1.0
# A client's request that its DEALER cannot queue (ZeroMQ's queue for the peer holds a
# thousand unread ones, or the socket has no connection) waits at most this long for room
# (`Peers.send`); then PeerTimeout.
SEND_S = 5.0
# A client tries to open a peer's lane at most this often (a daemon on another host, or
# not up yet, has none: the attempt is one failed connect(2)). After a try that found none,
# the next is LANE_FIRST_RETRY_S later, each wait twice the one before, up to LANE_RETRY_S:
# a shard opens its lane just after it binds, and a worker's first request, which may come
# before, went over ZeroMQ for a whole second (a short job's every step: about 20 % slower
# steps in 5 of 20 of bench/throughput.py's one-worker jobs).
LANE_RETRY_S = 1.0
LANE_FIRST_RETRY_S = 0.01


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files (`ulimit -n`) to its hard limit, at
    most FD_LIMIT (never lowering it); the (soft, hard) limits then. A daemon takes a
    descriptor for each connection to it: under the usual soft limit of 1,024 (with a hard
    limit far above), a job of about a thousand peers of one daemon, or anyone holding a
    thousand connections open to its port, left it none, and the coordinator, unable to
    write its state file, exited and ended the job."""
    if resource is None:
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft, hard


def _base(sock: zmq.Socket, max_frame: int = wire.MAX_MESSAGE) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)  # larger frames: ZeroMQ drops the connection
    sock.copy_threshold = COPY_THRESHOLD
    return sock


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enums cost microseconds an operation
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: Sequence[Any], copy: bool, flags: int = 0) -> None:
    """`sock.send_multipart(frames, copy=copy, flags=flags)` for wire.encode's frames
    (bytes and byte views), without pyzmq's per-frame `zmq.SNDMORE | flags` (an enum made
    each frame). `flags` go with the first frame: with NOBLOCK, zmq.Again says that nothing
    was queued (a message's later frames go where its first did, and are never refused)."""
    send = sock.send   # (looked up once: pyzmq's Socket has a Python `__getattr__`, which every lookup passes)
    last = len(frames) - 1
    if last:
        send(frames[0], _SNDMORE | flags, copy=copy)
        for k in range(1, last):
            send(frames[k], _SNDMORE, copy=copy)
        flags = 0
    send(frames[last], flags, copy=copy)


def recv_frames(sock: zmq.Socket, most: int = wire.MAX_FRAMES + 3) -> list:
    """`sock.recv_multipart(zmq.NOBLOCK, copy=False)`, each next part asked of the frame
    just read (`Frame.more`) instead of a `getsockopt(zmq.RCVMORE)` (an enum made each part).
    At most `most` frames are kept (by default one more than a message of psgd's, with a
    routing identity, has: `wire.decode` refuses it as too large): the rest are read and
    dropped. A message of 500,000 empty frames (1 MB on the wire) made 130 MB of frame
    objects in a daemon, and 100 MB of them would have made 13 GB."""
    recv = sock.recv   # (looked up once, as in `send_frames`)
    f = recv(_NOBLOCK, copy=False)
    frames = [f]
    while f.more:
        f = recv(_NOBLOCK, copy=False)
        if len(frames) < most:
            frames.append(f)
    return frames


def readable(sock: zmq.Socket) -> bool:
    """A whole message waits on `sock` (cheaper than a NOBLOCK recv raising zmq.Again)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


_auth: dict[int, list] = {}  # id(context) -> [its ZAP authenticator, how many daemons use it]
_auth_lock = threading.Lock()


def _start_auth(ctx: zmq.Context, keys: str) -> None:
    """One ZAP authenticator per context: only keys in KEYS/authorized may connect.
    Daemons that share a context (in one process) share it: it stops with the last
    (`stop_auth`); without it, ZeroMQ's CURVE servers would take any client key."""
    with _auth_lock:
        if id(ctx) in _auth:
            _auth[id(ctx)][1] += 1
            return
        from zmq.auth.thread import ThreadAuthenticator
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=os.path.join(keys, "authorized"))
        _auth[id(ctx)] = [auth, 1]


def stop_auth(ctx: zmq.Context, every: bool = False) -> None:
    """A daemon of this context is done with its authenticator (`every`: all of them)."""
    with _auth_lock:
        held = _auth.get(id(ctx))
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0 and not every:
            return
        del _auth[id(ctx)]
    held[0].stop()


def _load_pair(keys: str, name: str) -> tuple[bytes, bytes]:
    """The pair in KEYS/NAME.key_secret; a ConfigError (one line, before any socket) if it
    is missing or is no key file (`psgd keys` makes them)."""
    path = os.path.join(keys, f"{name}.key_secret")
    public, secret = _certificate(path, keys)
    if secret is None:
        raise ConfigError(f"security.keys: {path} holds no secret key ({_replace(path, keys)})")
    if zmq.has("curve") and zmq.curve_public(secret) != public:   # (a libzmq without CURVE: its sockets say so)
        raise ConfigError(f"security.keys: {path}'s public and secret keys are not one pair ({_replace(path, keys)})")
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:   # (gone since it was read: the pair read stands)
        mode = 0
    if mode & 0o044 and path not in _said_readable:   # (once a process: every socket loads its pair)
        _said_readable.add(path)
        log("keys", f"warning: {path} is readable by other users (mode {mode:03o}): whoever reads it can join "
                    f"the job; chmod 600 {path}")
    return public, secret


_said_readable: set[str] = set()   # the secret key files said to be readable by others


# The key files' keys as this process's sockets first loaded them (by file): a daemon keeps
# the keys it started with, as a server keeps the authorized/ it read at its start. Each
# reconnect (a heartbeat unanswered, a shard restarted) loaded them again: a key file
# replaced during a job (`psgd keys` in another folder copied over it) gave that daemon's
# next connection a key the servers never accepted, and one cut short or removed raised a
# ConfigError inside its heartbeat thread, which ended: the worker was dropped for silence.
_socket_keys: dict[str, tuple[bytes, bytes | None]] = {}
_socket_keys_lock = threading.Lock()


def forget_socket_keys() -> None:
    """A new job in this process (`psgd.connect` in a long-lived one, `make_keys`): its
    sockets load the key files as they are now, not as an earlier job's first did."""
    with _socket_keys_lock:
        _socket_keys.clear()


def _socket_pair(keys: str, name: str) -> tuple[bytes, bytes]:
    """KEYS/NAME.key_secret's pair (`_load_pair`), as this process first loaded it."""
    path = os.path.abspath(os.path.join(keys, f"{name}.key_secret"))
    with _socket_keys_lock:
        if path not in _socket_keys:
            _socket_keys[path] = _load_pair(keys, name)
        public, secret = _socket_keys[path]
    assert secret is not None
    return public, secret


def _socket_server_key(keys: str) -> bytes:
    """The servers' public key in KEYS/server.key (`_certificate`), as this process first loaded it."""
    path = os.path.abspath(os.path.join(keys, "server.key"))
    with _socket_keys_lock:
        if path not in _socket_keys:
            _socket_keys[path] = _certificate(path, keys)
        return _socket_keys[path][0]


def _replace(path: str, keys: str) -> str:
    """How to mend a key file that is there but wrong (`psgd keys` keeps the keys it finds,
    a public key alone too)."""
    if not path.endswith("_secret"):
        return "copy it again from the folder `psgd keys` made"
    pair = path[:-len("_secret")]
    return f"copy it again from the folder `psgd keys` made, or remove {pair}(_secret) and run `psgd keys {keys}`"


def _is_key(key: bytes) -> bool:
    """A CurveZMQ key as a key file holds it: 32 bytes in 40 Z85 characters."""
    from zmq.utils.z85 import Z85CHARS
    return len(key) == 40 and all(c in Z85CHARS for c in key)


def _certificate(path: str, keys: str) -> tuple[bytes, bytes | None]:
    """The (public, secret or None) keys of a key file, each checked: one cut short or
    changed made the daemons' sockets fail with a bare "Invalid argument" traceback. The
    message never shows a key."""
    import zmq.auth
    if not os.path.isfile(path):
        how = (f"make keys with `psgd keys {keys}`" if path.endswith("_secret") else
               "copy it from the folder `psgd keys` made: it is the servers' public key")   # (a new pair's is not)
        raise ConfigError(f"security.keys: {path} not found ({how})")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:   # not a key file (pyzmq: "No public key found in ...")
        raise ConfigError(f"security.keys: {path} is not a key file ({e}; {_replace(path, keys)})") from None
    for what, key in (("public", public), ("secret", secret)):
        if key is not None and not _is_key(key):
            raise ConfigError(f"security.keys: {path}'s {what} key is malformed (not 40 Z85 characters: the file "
                              f"was cut short or changed; {_replace(path, keys)})")
    return public, secret


def _authorized(keys: str) -> str:
    """KEYS/authorized, the public keys a server accepts; a ConfigError if it holds none
    (the server would refuse every client, each of them until cluster.timeout_s)."""
    folder = os.path.join(keys, "authorized")
    if not os.path.isdir(folder) or not any(n.endswith(".key") for n in os.listdir(folder)):
        raise ConfigError(f"security.keys: {folder} holds no client's public key (*.key), so this server would "
                          f"refuse every client: copy the whole folder `psgd keys` made")
    return folder


def check_keys(keys: str) -> None:
    """A ConfigError unless `keys` holds what every daemon of a CurveZMQ job loads, each
    file a key file."""
    server, _ = _load_pair(keys, "server")
    _load_pair(keys, "client")
    path = os.path.join(keys, "server.key")
    if _certificate(path, keys)[0] != server:
        # (a client with another server's key fails every handshake without a word: its
        # requests went unanswered, and a worker blamed the shards for not answering)
        raise ConfigError(f"security.keys: {path} is not the public key of {os.path.join(keys, 'server.key_secret')}"
                          f" (a key of servers re-keyed since?): copy server.key from the folder `psgd keys` made "
                          f"with that pair")
    _authorized(keys)


def server_socket(ctx: zmq.Context, address: str, security: SecurityConfig,
                  max_frame: int = wire.MAX_HEADER) -> zmq.Socket:
    """A ROUTER bound to `address`; frames over `max_frame` bytes cut the sender off."""
    if security.curve:   # (the keys first: a missing one leaves no socket, nor a share of the authenticator)
        public, secret = _socket_pair(security.keys, "server")
        _authorized(security.keys)
    raise_fd_limit()   # (before its socket: a daemon's first)
    sock = _base(ctx.socket(zmq.ROUTER), max_frame)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.SNDHWM, SERVER_SNDHWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(SERVER_HANDSHAKE_S * 1000))
    if security.curve:
        _start_auth(ctx, security.keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close()
        if security.curve:
            stop_auth(ctx)   # this daemon's share of the authenticator: it will not serve
        if e.errno == zmq.EADDRINUSE:
            raise AddressInUse(f"cannot listen on {address}: the port is in use (another job or program has it)"
                               ) from None
        raise OSError(f"cannot bind {address}: {e}") from None
    return sock


class AddressInUse(OSError):
    """A daemon's port is taken. Its process exits with `EXIT_ADDRESS_IN_USE`, so that
    `psgd run` can move a job whose ports it chose itself to another block."""


EXIT_ADDRESS_IN_USE = 98  # errno EADDRINUSE on Linux


def client_socket(ctx: zmq.Context, address: str, security: SecurityConfig, connect: bool = True) -> zmq.Socket:
    sock = _base(ctx.socket(zmq.DEALER))
    if security.curve:
        public, secret = _socket_pair(security.keys, "client")
        server_public = _socket_server_key(security.keys)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public
    if connect:
        sock.connect(address)
    return sock


def bind_address(address: str) -> str:
    """The address a daemon binds for an advertised tcp://HOST:PORT (all interfaces
    unless HOST is loopback)."""
    if address.startswith("tcp://"):
        host, port = tcp_parts(address)
        if not host.startswith(LOOPBACK):
            return f"tcp://*:{port}"
    return address


def unreachable(address: str, timeout_s: float = 1.0) -> str:
    """Why a peer at tcp://HOST:PORT that did not answer cannot be reached, as far as a
    plain TCP connection tells: its host does not resolve, nothing listens there, no route
    or no answer to the connection; '' where it connects (the peer is there and did not
    answer: another job's, or one that answers later) or where this cannot tell. For a
    give-up's message: ZeroMQ retries all of these alike, and the give-up said only "no
    answer ... is it running there?" after cluster.timeout_s."""
    if not address.startswith("tcp://"):
        return ""
    host, port = tcp_parts(address)
    host = host.strip("[]")
    if not host or host == "*" or not port.isdigit():
        return ""
    import socket
    try:
        socket.getaddrinfo(host, int(port))
    except socket.gaierror as e:
        return f"the host {host!r} does not resolve ({e.strerror or e})"
    except (OSError, UnicodeError):
        return ""
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return f"nothing listens at {host}:{port} (connection refused)"
    except TimeoutError:
        return f"{host}:{port} took no connection within {timeout_s:g} s (a host that is down, or a firewall?)"
    except OSError as e:
        return f"{host}:{port} cannot be reached ({e.strerror or e})"
    return ""


def is_loopback(address: str) -> bool:
    return not address.startswith("tcp://") or address[6:].startswith(LOOPBACK)


class Peers:
    """DEALER sockets to a list of peers, with request ids and deadlines."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context, addresses: Sequence[str], security: SecurityConfig, lane: bool = False,
                 spin_s: float = 0.0):
        """`lane`: send a request on the peer's same-host lane (psgd.lane) where there is
        one and the request fits it; never with CurveZMQ (a lane has no handshake). A wait
        for an answer looks for it for up to `spin_s` before it sleeps (`spinning.Spinner`)."""
        self.addresses = list(addresses)
        self.security = security
        self.ctx = ctx
        self.lane = lane and not security.curve
        self.spinner = Spinner(spin_s)
        self.lanes: list[lanes.Conn | None] = [None for _ in self.addresses]   # each peer's lane, if open
        self._lane_peer: dict[int, int] = {}   # an open lane's descriptor -> its peer
        self._lane_at = [0.0 for _ in self.addresses]   # time.monotonic() when `send` may next try to open one
        self._lane_wait = [LANE_FIRST_RETRY_S for _ in self.addresses]   # ... after a try that finds none
        self.socks, self.monitors = [], []   # each peer's socket, and its handshakes' monitor (see `refused`)
        for a in self.addresses:
            sock, monitor = self._open(a)
            self.socks.append(sock)
            self.monitors.append(monitor)
        self.why = ["" for _ in self.socks]                       # the last handshake's refusal, per peer
        # when this client read each peer's latest successful handshake (monotonic; up to MONITOR_READ_S after
        # it happened): a connection made again since a request left (ZeroMQ reconnects a dropped TCP
        # connection on its own) may have lost the request, or its answer, sent to the old connection
        self.handshook = [0.0 for _ in self.socks]
        self._read_monitors_at = 0.0   # time.monotonic() when wait() next reads every monitor (MONITOR_READ_S)
        self._pollers: dict[frozenset, zmq.Poller] = {}   # by the peers it polls; made again on a reconnect
        self.bytes_sent = 0
        self.bytes_recv = 0

    def _open(self, address: str) -> tuple[zmq.Socket, zmq.Socket]:
        """A socket to `address` and its monitor, watching before it connects: a handshake
        refused at once is seen too (a monitor started after it could miss it, and the
        refusal passed for silence until cluster.timeout_s)."""
        sock = client_socket(self.ctx, address, self.security, connect=False)
        monitor = sock.get_monitor_socket(_AUTH | _PROTOCOL | _SUCCEEDED,
                                          addr=f"inproc://psgd-monitor-{os.getpid()}-{next(_monitors)}")
        sock.connect(address)
        return sock, monitor

    def reconnect(self, i: int) -> None:
        """Drop pending traffic to peer i and open a fresh connection."""
        self._close(i)
        self._close_lane(i)
        self._lane_at[i] = 0.0   # (a lane too, a new one, at the next send)
        self._lane_wait[i] = LANE_FIRST_RETRY_S
        self._pollers.clear()   # (they hold the closed socket)
        self.socks[i], self.monitors[i] = self._open(self.addresses[i])
        self.why[i] = ""

    def refused(self, i: int) -> str:
        """Why peer i refused this client's handshake, if its last handshake was refused
        ('' if not; one that succeeded since ends an earlier refusal): asked when an
        answer is overdue, not on the way of every request. It reads the monitor's queued
        events, which `wait` also does every MONITOR_READ_S."""
        from zmq.utils.monitor import recv_monitor_message
        while readable(self.monitors[i]):
            e = recv_monitor_message(self.monitors[i], zmq.NOBLOCK)
            self.why[i] = handshake_failure(int(e["event"]), int(e["value"]))
            if int(e["event"]) == _SUCCEEDED:
                self.handshook[i] = time.monotonic()
        return self.why[i]

    def send(self, i: int, op: str, rid: int | None = None, copy: bool = False, **kw: Any) -> int:
        """Send a request to peer i (under a new id, or `rid`: a resend); its id. Its
        arrays' frames over COPY_THRESHOLD are ZeroMQ's to read until they have left:
        the caller rewrites them only once an answer shows that they did. `copy`: ZeroMQ
        gets copies of them now (a resend, which an earlier send's answer does not wait for).
        PeerTimeout if it cannot be queued within SEND_S (`_send_unqueued`)."""
        if rid is None:
            rid = next(self._ids)
        # (`kw` is this call's own dict: the header's fields are taken out of it, not spread
        # into `wire.encode`'s keywords and collected again)
        frames = wire.encode_with(op, rid, kw.pop("rank", -1), kw.pop("clock", -1), kw.pop("arrays", ()), kw)
        size = sum(map(len, frames))   # (bytes, and byte views: len is their size)
        self.bytes_sent += size
        if self.lane:
            conn = self.lanes[i] or self._open_lane(i)
            if conn is not None and size + 4 * (len(frames) + 1) <= conn.max_message:
                try:
                    conn.send(frames, LANE_SEND_S)   # (written whole: nothing of the caller's is read later)
                    return rid
                except lanes.LaneError:
                    self._close_lane(i)   # (and the request goes over ZeroMQ)
        try:
            send_frames(self.socks[i], frames, copy, _NOBLOCK)
        except zmq.Again:
            self._send_unqueued(i, op, frames, copy)
        return rid

    def _send_unqueued(self, i: int, op: str, frames: list, copy: bool) -> None:
        """Send a request that peer i's socket did not queue. ZeroMQ does not connect again
        after a refused CurveZMQ handshake: the socket is left without a connection, and
        a send on it blocked for good (a heartbeat thread, or a script's `finish`, after a
        refusal). It goes on a fresh connection instead, whose refusal the next wait reads
        (`HandshakeFailed`). Otherwise the queue is full (a peer that reads none of its
        requests), or the connection ended for a reason the monitor does not name (a
        peer that is not psgd's): up to SEND_S for room, then PeerTimeout."""
        deadline = time.monotonic() + SEND_S
        while True:
            if self.refused(i):
                self.reconnect(i)   # (its queue is empty: the send below takes the request)
            try:
                send_frames(self.socks[i], frames, copy, _NOBLOCK)
                return
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(self.addresses[i], SEND_S, f"{op}: its request could not be queued") from None
                self.socks[i].poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLOUT)

    def _open_lane(self, i: int) -> lanes.Conn | None:
        """Peer i's lane, if it has one now (tried again sooner at first, then at most every
        LANE_RETRY_S)."""
        now = time.monotonic()
        if now < self._lane_at[i]:
            return None
        self._lane_at[i] = now + self._lane_wait[i]   # (before the try: one that raises waits too)
        conn = lanes.connect(self.addresses[i])
        if conn is None:
            self._lane_wait[i] = min(LANE_RETRY_S, 2 * self._lane_wait[i])
            return None
        self.lanes[i] = conn
        self._lane_peer[conn.fd] = i
        self._pollers.clear()   # (they poll the peer's lane too)
        return conn

    def _close_lane(self, i: int) -> None:
        """Close peer i's lane: what it carried may be lost, as on a connection made again
        (`handshook`)."""
        conn = self.lanes[i]
        if conn is None:
            return
        self.lanes[i] = None
        del self._lane_peer[conn.fd]
        self._pollers.clear()
        conn.close()
        now = time.monotonic()
        self.handshook[i] = now
        self._lane_at[i] = now + LANE_RETRY_S   # (its daemon may be stopping: a second, then 10 ms on)
        self._lane_wait[i] = LANE_FIRST_RETRY_S

    def wait(self, pending: dict[int, int], timeout: float, what: str,
             cancel: Callable[[], bool] | None = None) -> dict[int, wire.Message]:
        """Wait for replies: pending maps request id -> peer index. Returns id -> Message.
        Error replies raise RemoteError; a missing answer (or `cancel()` turning true)
        raises PeerTimeout, whose `partial` holds the replies that did arrive. At the
        deadline, what has come is still read, without waiting: a thread that got no CPU
        until past it (a daemon's heartbeat on a loaded machine) took its answer, the
        job's `done`, for none, and the fresh connection it sent the next on dropped it."""
        got: dict[int, wire.Message] = {}
        start = time.monotonic()
        deadline = start + timeout
        polled = last_look = False
        peers = frozenset(pending.values())
        while len(got) < len(pending):
            poller = self._pollers.get(peers)
            if poller is None:   # (one a set of peers, kept: a step's wait does not build and register one)
                poller = self._pollers[peers] = zmq.Poller()
                for i in peers:
                    poller.register(self.socks[i], _POLLIN)
                    if self.lanes[i] is not None:
                        poller.register(cast(lanes.Conn, self.lanes[i]).fd, _POLLIN)
            now = time.monotonic()
            if now >= self._read_monitors_at:   # (a comparison a poll; the reads, once a second at most)
                self._read_monitors_at = now + MONITOR_READ_S
                for i in range(len(self.monitors)):
                    self.refused(i)
            left = deadline - now
            if (left <= 0 and last_look) or (cancel is not None and polled and cancel()):
                missing = sorted({pending[r] for r in pending if r not in got})
                for i in missing:
                    why = self.refused(i)
                    if why:
                        raise HandshakeFailed(f"{self.addresses[i]} did not let this client in ({what}): {why}")
                exc = PeerTimeout(self.addresses[missing[0]], timeout - max(0.0, left), what)
                exc.partial = got
                raise exc
            polled = True  # cancel() is asked only after a poll: an answer already here is taken
            last_look = left <= 0
            events = self.spinner.poll(poller, left) if left > 0 else None
            for sock, _ in events or poller.poll(max(0, int(min(left, 0.2 if cancel else 1.0) * 1000))):
                if type(sock) is int:   # a lane's descriptor
                    self._read_lane(self._lane_peer.get(sock, -1), pending, got)
                    continue
                more = True   # (POLLIN: a whole message waits; `readable` asks for each next one)
                while more:
                    try:
                        frames = recv_frames(sock)
                    except zmq.Again:   # (none after all: polled again)
                        break
                    more = readable(sock)
                    self._take(frames, pending, got)
        return got

    def _read_lane(self, i: int, pending: dict[int, int], got: dict[int, wire.Message]) -> None:
        """Take the answers that have come on peer i's lane (as `wait` does the socket's)."""
        conn = self.lanes[i] if i >= 0 else None
        if conn is None:   # (closed since the poll)
            return
        try:
            messages = conn.messages(wire.MAX_MESSAGE)
        except lanes.LaneError:
            self._close_lane(i)
            return
        for frames in messages:
            self._take(frames, pending, got)

    def _take(self, frames: list, pending: dict[int, int], got: dict[int, wire.Message]) -> None:
        """An answer's frames: into `got` if it is one `pending` waits for (an error reply
        raises its RemoteError); one that cannot be read raises BadAnswer where its header
        names a request that waits (an answer past `wire.MAX_MESSAGE`, a tournament's model
        of over 2 GiB a shard, was dropped, and the request sent again for good), and is
        dropped where it names none (garbled: the deadline covers it)."""
        self.bytes_recv += sum(map(len, frames))   # (a Frame's len is its size: no memoryview made)
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            if e.request_id in pending and e.request_id not in got:
                raise wire.BadAnswer(e.code, f"its answer cannot be read here: {e.reason}",
                                     self.addresses[pending[e.request_id]]) from None
            return
        if msg.id in pending and msg.id not in got:
            wire.raise_if_error(msg, self.addresses[pending[msg.id]])
            got[msg.id] = msg

    def call(self, i: int, op: str, timeout: float, what: str = "", cancel: Callable[[], bool] | None = None,
             **kw: Any) -> wire.Message:
        rid = self.send(i, op, **kw)
        return self.wait({rid: i}, timeout, what or op, cancel)[rid]

    def _close(self, i: int) -> None:
        """The socket's monitoring ends first: a monitor's reader closed while the socket
        is still monitored leaves ZeroMQ's I/O thread blocked for good on the next event
        (a handshake under way completing), and with it every socket of this process
        (libzmq#3575): a worker's heartbeats stopped, and it was dropped."""
        with contextlib.suppress(zmq.ZMQError):   # (nothing here may raise)
            self.socks[i].disable_monitor()
        self.monitors[i].close(0)
        self.socks[i].close(0)

    def close(self) -> None:
        for i in range(len(self.socks)):
            self._close(i)
            self._close_lane(i)


Reply = tuple[Hashable, list]             # (routing identity, frames)
Handler = Callable[[Any, wire.Message], list[Reply]]


class Service:
    """A ROUTER socket served through a table of op -> handler. A handler gets the
    sender's routing identity and the validated message and returns the replies to
    send now (its own, and any it releases); it may answer later by returning them
    from a later call. Every failure is an error reply with the request's id:

    - a message that fails validation: its code, whenever the header could be read;
    - an op this daemon does not serve: `unknown_op`, at once;
    - a handler that raises WireError: its code; any other exception: `internal`,
      logged with the op.

    Each of them adds one to `counters["bad_messages"]`; nothing ends the loop. The log
    says the first at once (its code and reason), and the rest at most once every
    BAD_LOG_S, counted, with the latest (`_bad`): a peer sending garbage does not flood it.
    `busy_s` is the CPU time spent serving: from taking a message off the socket to
    handing its replies to ZeroMQ, on this thread (a shard's share of the wall time: is
    it the bottleneck?). CPU time, not wall time: a process waiting for a core on a
    busy machine is not serving."""

    def __init__(self, sock: zmq.Socket, handlers: Mapping[str, Handler], name: str,
                 max_bytes: int = wire.MAX_MESSAGE, counters: dict | None = None,
                 sent: Callable[[], None] | None = None, role: str = "", lane: lanes.Listener | None = None,
                 spin_s: float = 0.0, watching: bool = False):
        """`lane`, when given, is where same-host clients connect (psgd.lane): their requests
        are served as the socket's, under a routing token of their own (an int), and
        answered on their lane. `poll` looks for a request (on the socket and the lanes)
        for up to `spin_s` before it sleeps (`spinning.Spinner`). `sent`, when given, is called after the replies
        of each event have been handed to ZeroMQ; `in_flight` then says whether ZeroMQ may
        still read any of their frames.
        `name` is what error replies call the daemon ("the coordinator", "shard 0"), `role`
        what its log lines do (`server-0`; default: `name` without its "the ").
        `watching`: its handlers may `watch` peers' connections."""
        self.sock = sock
        self.handlers = handlers
        self.name = name
        self.role = role or name.removeprefix("the ")
        self.max_bytes = max_bytes
        self.counters = counters if counters is not None else {}
        self.counters.setdefault("bad_messages", 0)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.sent = sent
        self._trackers: list[zmq.MessageTracker] = []  # of zero-copy frames (larger than COPY_THRESHOLD)
        self._unread: dict[Hashable, list[zmq.MessageTracker]] = {}   # a tracker a large reply, by peer
        self._prune_at = PRUNE_TRACKERS   # `send` forgets those done when it holds this many
        self.busy_s = 0.0
        self._unsaid = 0              # bad messages since the log last said any
        self._latest_bad = ""         # the latest of them
        self._say_bad_at = 0.0        # time.monotonic() from which the log may say them
        self._fd = cast(int, sock.getsockopt(zmq.FD))   # (a descriptor of its own to dup: `_check_fds`)
        self._check_fds_at = 0.0      # time.monotonic() when `poll` next checks for a free descriptor
        self._out_of_fds = 0          # checks in a row that found none (0: it has them)
        self._fds_back = 0            # checks in a row that found one since the log said it had none
        self._say_fds_at = 0.0        # time.monotonic() from which the log may say it again
        self.lane = lane
        self.spinner = Spinner(spin_s)
        self._leaving: list[zmq.MessageTracker] | None = None   # `track_leaving`: the replies since
        self._lanes: dict[int, lanes.Conn] = {}       # the lanes open to it, by descriptor
        self._lane_of: dict[int, lanes.Conn] = {}     # ... by routing token
        self._lanes_waiting = False   # the listener is not polled: no descriptor was free to take a lane
        if lane is not None:
            self.poller.register(lane.fd, zmq.POLLIN)
        self._from: zmq.Frame | None = None   # the routing identity's frame of the message being served (`watch`)
        self._watching = watching
        self._closes: zmq.Socket | None = None   # the monitor of the socket's closed connections (`watch`)
        self._watched: dict[int, set[Hashable]] = {}   # a connection's descriptor -> the peers watched on it
        self._closed_fds: set[int] = set()    # descriptors whose last connection closed (none accepted since)
        self._gone: set[Hashable] = set()     # watched peers whose connection closed (ZeroMQ never reuses an id)
        self._untold: list[Hashable] = []     # ... not yet told by `closed`

    BAD_LOG_S = 60.0   # the log says bad messages at most once this often
    FDS_CHECK_S = 1.0  # how often `poll` checks that the process has a descriptor free

    def _bad(self, what: str) -> None:
        """Count a bad message (`what`: its code and reason) and say it: the first at once,
        later ones at most every BAD_LOG_S in one line (`_say_bad`). The log said none of
        them (a shard fuzzed with 6,000 garbled messages said nothing; summary.json's
        count was the first sign), but each handler's exception (`internal`), one line a
        message, however fast a peer sent them."""
        self.counters["bad_messages"] += 1
        self._unsaid += 1
        self._latest_bad = what[:300]
        if time.monotonic() >= self._say_bad_at:
            self._say_bad()

    def _say_bad(self) -> None:
        """Say the bad messages not said yet, in one line."""
        n, self._unsaid = self._unsaid, 0
        self._say_bad_at = time.monotonic() + self.BAD_LOG_S
        if n == 1:
            log(self.role, f"a bad message: {self._latest_bad}")
        else:
            log(self.role, f"{n} bad messages in the last {self.BAD_LOG_S:.0f} s (bad_messages counts them); "
                           f"the latest: {self._latest_bad}")

    def poll(self, timeout_ms: int) -> None:
        """Serve whatever arrives within `timeout_ms` (and what is queued, see `drain`)."""
        events = self.spinner.poll(self.poller, timeout_ms / 1000)
        if not events:
            events = self.poller.poll(timeout_ms)
        if events:
            if self.lane is None:
                self.drain()
            else:
                self._on_events(events)
        now = time.monotonic()
        if self._unsaid and now >= self._say_bad_at:
            self._say_bad()
        if now >= self._check_fds_at:
            self._check_fds_at = now + self.FDS_CHECK_S
            self._check_fds(now)

    def _check_fds(self, now: float) -> None:
        """Say when this process has no file descriptor free, and when it has them again. A
        process without one accepts no connection (ZeroMQ's accept fails; the peer waits in
        the kernel's queue, then times out) and opens no file: a job with more peers of one
        daemon than `ulimit -n` allows, or someone holding connections open to its port,
        left its workers saying only "shard at ... did not answer within cluster.timeout_s"."""
        try:
            os.close(os.dup(self._fd))
            if self._lanes_waiting and self.lane is not None:   # (the lanes waiting are taken now)
                self._lanes_waiting = False
                self.poller.register(self.lane.fd, zmq.POLLIN)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                return
            self._out_of_fds += 1
            self._fds_back = 0
            if now >= self._say_fds_at:
                self._say_fds_at = now + self.BAD_LOG_S
                where = cast(bytes, self.sock.getsockopt(zmq.LAST_ENDPOINT)).decode(errors="replace")
                log(self.role, f"out of file descriptors ({fd_limit()}; {os.strerror(e.errno)}): it accepts no new "
                               f"connection on {where} and opens no file until some close. Each connection "
                               f"takes one: a job with more peers of this daemon than that, or connections "
                               f"held open to its port by something else (one that does not finish its handshake "
                               f"is dropped after {SERVER_HANDSHAKE_S:.0f} s); raise `ulimit -n`")
            return
        if self._out_of_fds:
            self._fds_back += 1
            if self._fds_back >= 3:   # (a descriptor freed for a moment, taken by the next connection, is not it)
                self._out_of_fds = self._fds_back = 0
                log(self.role, "has file descriptors again: accepting connections")

    DRAIN_S = 0.05   # at most this long serving before `drain` returns to the daemon's loop

    def drain(self) -> None:
        """Serve what is queued, for at most DRAIN_S: a peer that keeps the socket busy
        does not keep the daemon's own loop (its heartbeats, its stop) from running.
        A handler's token is the sender's routing identity as bytes: the same peer's
        requests carry equal tokens (ZeroMQ's frames compare by object)."""
        until = time.monotonic() + self.DRAIN_S
        while readable(self.sock):
            t0 = time.thread_time()
            frames = recv_frames(self.sock)
            if len(frames) < 2:
                self._bad("a message without a routing identity")
            else:   # (one without a routing identity has nobody to answer)
                self._from = frames[0]
                try:
                    self.send(self._serve(frames[0].bytes, frames[1:]))
                finally:
                    self._from = None
                self.busy_s += time.thread_time() - t0
            if time.monotonic() > until:
                return

    def _closes_monitor(self) -> zmq.Socket:
        """A monitor of the socket's connections made and closed, every one (not only the
        watched: ZeroMQ monitors a socket whole). Its queue has no bound: one holding about
        two thousand events unread (its ends' default high-water marks) blocked ZeroMQ's I/O
        thread, and `disable_monitor` with it, whose wait holds the GIL (a thousand workers'
        connections closing between two reads)."""
        addr = f"inproc://psgd-closes-{os.getpid()}-{next(_monitors)}"
        self.sock.monitor(addr, _ACCEPTED | _DISCONNECTED)
        try:
            monitor = self.sock.context.socket(zmq.PAIR)
        except zmq.ZMQError:
            self.sock.disable_monitor()
            raise
        monitor.rcvhwm = 0
        monitor.linger = 0
        monitor.connect(addr)
        return monitor

    def watch(self, ident: Hashable) -> bool:
        """From now on, tell (`closed`) when the connection that the message being served
        came on closes: the peer's process ended (killed, crashed: its kernel closes its
        connections; a process stopped with SIGSTOP, or cut off by the network, keeps them
        open), or the peer closed that socket. False, and nothing watched, if that
        connection is known to have closed already (its message was read after its close):
        that peer is not there. Only a handler of a Service made `watching` calls it; a
        lane's peer is not watched (True), nor one whose connection closed before the first
        `watch` (made then, the monitor did not see it)."""
        if type(ident) is int or self._from is None or not self._watching:
            return True
        try:
            if self._closes is None:   # (made at the first: a socket closed without `close` had left it open)
                self._closes = self._closes_monitor()
        except zmq.ZMQError:   # (no descriptor free: watched at a later message)
            return True
        self._read_closes()   # (a close of the descriptor's last connection is read before its next is watched)
        if ident in self._gone:
            return False
        try:
            fd = self._from.get(_SRCFD)
        except zmq.ZMQError:   # (a libzmq without ZMQ_SRCFD, deprecated in 4.3: nothing is told)
            return True
        if fd in self._closed_fds:   # (its first message watched: its close was read, with nobody to tell)
            self._gone.add(ident)
            return False
        self._watched.setdefault(fd, set()).add(ident)
        return True

    def _read_closes(self) -> None:
        """Take the monitor's queued events: each closed connection's watched peers are
        gone, to be told by `closed`. A connection's close is queued before its descriptor
        can be taken by the next connection, and a connection's making before its first
        message: read before a message is watched, they say whether its connection is
        still open."""
        from zmq.utils.monitor import recv_monitor_message
        while self._closes is not None and readable(self._closes):
            e = recv_monitor_message(self._closes, zmq.NOBLOCK)
            fd = int(e["value"])
            if int(e["event"]) == _ACCEPTED:
                self._closed_fds.discard(fd)
                continue
            self._closed_fds.add(fd)
            gone = self._watched.pop(fd, ())
            self._gone.update(gone)
            self._untold.extend(gone)

    def closed(self) -> list[Hashable]:
        """The watched peers whose connection has closed since the last call (`watch`),
        each told once. Ask it often (a daemon's loop does): the monitor's queue of every
        closed connection has no bound."""
        self._read_closes()
        told, self._untold = self._untold, []
        return told

    def close(self) -> None:
        """Close the socket (linger 0) and its monitor, if any."""
        try:
            if self._closes is not None:
                self._read_closes()
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.disable_monitor()
        finally:
            if self._closes is not None:
                self._closes.close(0)
                self._closes = None
            self.sock.close(0)

    def _on_events(self, events: list) -> None:
        """Serve the socket's messages, new lanes and the lanes' messages (`poll`)."""
        for what, event in events:
            if what is self.sock:
                self.drain()
            elif what == cast(lanes.Listener, self.lane).fd:
                self._accept_lanes(cast(lanes.Listener, self.lane))
            elif (conn := self._lanes.get(what)) is not None:
                try:
                    if event & zmq.POLLOUT and not conn.flush():
                        self.poller.register(conn.fd, zmq.POLLIN)   # (all written: readable only)
                    if event & (zmq.POLLIN | zmq.POLLERR):
                        for frames in conn.messages(self.max_bytes):
                            t0 = time.thread_time()
                            self.send(self._serve(conn.ident, frames))
                            self.busy_s += time.thread_time() - t0
                except lanes.LaneError as e:
                    self._close_lane(conn, e)

    def _accept_lanes(self, listener: lanes.Listener) -> None:
        """Take the lanes that clients opened. Out of descriptors, the listener is not
        polled until `_check_fds` finds one free (asked every FDS_CHECK_S): a lane waiting
        in its queue kept the poll returning at once, a CPU spent on nothing."""
        try:
            while (conn := listener.accept()) is not None:
                self._lanes[conn.fd] = self._lane_of[conn.ident] = conn
                self.poller.register(conn.fd, zmq.POLLIN)
        except OSError:
            self.poller.unregister(listener.fd)
            self._lanes_waiting = True

    def _close_lane(self, conn: lanes.Conn, why: lanes.LaneError) -> None:
        if self._lanes.pop(conn.fd, None) is None:
            return
        del self._lane_of[conn.ident]
        self.poller.unregister(conn.fd)
        conn.close()
        if why.bad:
            self._bad(f"a lane closed: {why}")

    def _offer(self, ident: int, frames: list) -> None:
        """Answer on lane `ident`, if it is still open (a closed one has nobody to answer)."""
        conn = self._lane_of.get(ident)
        if conn is None:
            return
        try:
            conn.offer(frames, copy=self.sent is None)   # (kept as views only where `in_flight` is asked)
        except lanes.LaneError as e:
            self._close_lane(conn, e)
            return
        if conn.queued:   # the rest when the socket is writable
            self.poller.register(conn.fd, zmq.POLLIN | zmq.POLLOUT)

    def close_lanes(self) -> None:
        """Stop taking lanes, and close those open."""
        for conn in list(self._lanes.values()):
            self._close_lane(conn, lanes.LaneError("the daemon stopped"))
        if self.lane is not None:
            if not self._lanes_waiting:
                self.poller.unregister(self.lane.fd)
            self.lane.close()
            self.lane = None

    def _serve(self, ident: Hashable, body: list) -> list[Reply]:
        req_id, op = 0, "?"
        try:
            msg = wire.decode(body, self.max_bytes)
            req_id, op = msg.id, msg.op
            handler = self.handlers.get(op)
            if handler is None:
                raise wire.WireError(wire.UNKNOWN_OP, f"{self.name} does not serve {op!r} "
                                                      f"(it serves {', '.join(sorted(self.handlers))})")
            return handler(ident, msg)
        except wire.WireError as e:
            self._bad(f"{op if op != '?' else 'a request'}: {e.code}: {e.reason}")
            return [(ident, wire.error(req_id or e.request_id, e.code, e.reason))]
        except OutputError:   # the daemon's own files (a full disk), not the message: it exits 73
            raise             # (answered as a bad message, it served on and its peers were restarted)
        except Exception as e:  # a bug in a handler must not take the daemon down
            self._bad(f"error serving {op}: {type(e).__name__}: {e}")
            return [(ident, wire.error(req_id, wire.INTERNAL, f"{type(e).__name__}: {e}"))]

    def send(self, replies: list[Reply]) -> None:
        sock = self.sock
        # (a frame's len is its bytes: wire.encode's frames are bytes and byte views; one of wider
        # items is copied below its bytes' threshold, never shared where pyzmq would copy it)
        copied_below = sock.copy_threshold
        for ident, frames in replies:
            if type(ident) is int:   # (a lane's token: ZeroMQ's are bytes)
                self._offer(ident, frames)
                continue
            try:
                if self.sent is None:
                    if self._leaving is None:
                        self.sock.send_multipart([ident] + frames, copy=False)
                    else:
                        tracker = self.sock.send_multipart([ident] + frames, copy=False, track=True)
                        self._leaving.append(cast(zmq.MessageTracker, tracker))
                        if len(self._leaving) % PRUNE_TRACKERS == 0:   # (many workers beating meanwhile)
                            self._leaving = [t for t in self._leaving if not t.done]
                    continue
                if self._unsent_to(ident) >= MAX_UNREAD_REPLIES:   # a peer that does not read its answers
                    self._bad(f"a reply dropped: {MAX_UNREAD_REPLIES} large replies to its peer are unsent "
                              f"(the peer does not read its answers)")
                    continue
                sock.send(cast(bytes, ident), zmq.SNDMORE)
                held = None
                last = len(frames) - 1
                for k, f in enumerate(frames):  # each frame's tracker: `in_flight`
                    flags = zmq.SNDMORE if k < last else 0
                    if len(f) < copied_below:   # copied at send (as pyzmq does): nothing to track
                        sock.send(f, flags)
                        continue
                    t = sock.send(f, flags, copy=False, track=True)
                    if not t.done:
                        self._trackers.append(t)
                        held = t
                if held is not None:
                    self._unread.setdefault(ident, []).append(held)
            except zmq.ZMQError:
                pass  # the peer is gone; nothing to answer
        if self.sent is not None:
            if len(self._trackers) >= self._prune_at:   # (amortized: the live ones are looked at again later)
                self.in_flight()
                self._prune_at = max(PRUNE_TRACKERS, 2 * len(self._trackers))
                for ident in [i for i, held in self._unread.items() if all(t.done for t in held)]:
                    del self._unread[ident]   # (peers gone, or whose replies all left; one answered again
                                              # is pruned by `_unsent_to`)
            self.sent()

    def track_leaving(self) -> None:
        """From now on, keep track of each reply until ZeroMQ's I/O thread has taken it
        (every frame sent without a copy, so that its tracker says so: `leaving`). For a
        daemon's last answers: its socket is closed with linger 0, which discards what is
        still queued. Only for a daemon without `sent` (it tracks its large frames itself)."""
        assert self.sent is None
        self.sock.copy_threshold = 0
        if self._leaving is None:
            self._leaving = []

    def leaving(self) -> list[zmq.MessageTracker]:
        """The trackers of the replies sent since `track_leaving` that are still queued in
        ZeroMQ (its I/O thread has not taken them)."""
        self._leaving = [t for t in self._leaving or () if not t.done]
        return list(self._leaving)

    def _unsent_to(self, ident: Hashable) -> int:
        """How many large replies to this peer ZeroMQ has not sent yet."""
        held = self._unread.get(ident)
        if not held:
            return 0
        held[:] = [t for t in held if not t.done]
        if not held:
            del self._unread[ident]
        return len(held)

    def in_flight(self) -> bool:
        """May ZeroMQ, or a lane, still read a frame of a reply already sent? (Frames below
        COPY_THRESHOLD were copied at send; larger ones are read until their tracker is
        done; a lane's, until the kernel took the rest of them: `lanes.Conn.queued`.)"""
        self._trackers = [t for t in self._trackers if not t.done]
        return bool(self._trackers) or any(conn.queued for conn in self._lanes.values())
