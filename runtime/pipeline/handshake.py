"""The control connection between coordinator and worker, before a process group forms.

A plain TCP socket carrying length-prefixed JSON messages, every read bounded by a
timeout. First each side proves it holds the shared secret (the token file) without
sending it: each sends a random nonce and answers the other's with an HMAC-SHA256 of
both, so neither a wrong coordinator nor a wrong worker gets further. Then the
coordinator names the model (compared by sha256), the worker's layers and the
rendezvous of the process group.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import stat
import struct
from pathlib import Path

from ... import InferError
from ..registry import cache_dir
from ..wheels import file_sha256, write_atomic

HANDSHAKE_TIMEOUT = 10.0  # seconds for each message of the handshake
MAX_MESSAGE = 1 << 20  # bytes of one JSON message
PROTOCOL = "infer-pipeline-1"


class Refused(InferError):
    """The other end refused the connection (a wrong token, another model file)."""


def read_token(path: Path) -> bytes:
    """The shared secret in `path`: its bytes, surrounding whitespace stripped. The file
    must be readable by its owner only, as ssh asks of a private key."""
    try:
        mode = path.stat().st_mode
        token = path.read_bytes().strip()
    except OSError as e:
        raise InferError(f"--token-file {path}: cannot read it ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InferError(f"--token-file {path}: readable by others; chmod 600 {path}")
    if len(token) < 16:
        raise InferError(f"--token-file {path}: too short a secret (16 bytes or more)")
    return token


def send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def receive(sock: socket.socket, timeout: float = HANDSHAKE_TIMEOUT) -> dict:
    """The next message; a message {"error": ...} raises Refused with its text."""
    sock.settimeout(timeout)
    try:
        (n,) = struct.unpack(">I", _exactly(sock, 4))
        if n > MAX_MESSAGE:
            raise InferError(f"a control message of {n} bytes (at most {MAX_MESSAGE})")
        message = json.loads(_exactly(sock, n))
    except TimeoutError:
        raise InferError(f"no answer in {timeout:g} s") from None
    except (ValueError, UnicodeDecodeError):
        raise InferError("a control message that is not JSON") from None
    if not isinstance(message, dict):
        raise InferError("a control message that is not a JSON object")
    if "error" in message:
        raise Refused(str(message["error"]))
    return message


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise InferError("the connection closed")
        data += chunk
    return data


def _mac(token: bytes, role: bytes, mine: str, theirs: str) -> str:
    return hmac.new(token, role + bytes.fromhex(theirs) + bytes.fromhex(mine), "sha256").hexdigest()


def prove_worker(sock: socket.socket, token: bytes) -> None:
    """The worker's side: challenge the coordinator, then answer its challenge."""
    nonce = secrets.token_hex(32)
    send(sock, {"protocol": PROTOCOL, "nonce": nonce})
    reply = receive(sock)
    theirs = _hex(reply.get("nonce"))
    if not hmac.compare_digest(str(reply.get("mac")), _mac(token, b"coordinator", theirs, nonce)):
        send(sock, {"error": "wrong token: the worker's token file differs from the coordinator's"})
        raise Refused("refused a coordinator: wrong token")
    send(sock, {"mac": _mac(token, b"worker", nonce, theirs)})


def prove_coordinator(sock: socket.socket, token: bytes) -> None:
    """The coordinator's side of prove_worker."""
    hello = receive(sock)
    if hello.get("protocol") != PROTOCOL:
        raise InferError(f"not an infer worker of this version (it says {hello.get('protocol')!r})")
    theirs, nonce = _hex(hello.get("nonce")), secrets.token_hex(32)
    send(sock, {"nonce": nonce, "mac": _mac(token, b"coordinator", nonce, theirs)})
    reply = receive(sock)
    if not hmac.compare_digest(str(reply.get("mac")), _mac(token, b"worker", theirs, nonce)):
        raise Refused("wrong token: the worker's token file differs from the coordinator's")


def _hex(value) -> str:
    if not isinstance(value, str) or len(value) != 64:
        raise InferError("a malformed nonce")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise InferError("a malformed nonce") from None
    return value


def model_sha256(path: Path) -> str:
    """The sha256 both ends compare: a file's own; for a directory, of each regular file's
    relative name and sha256, in name order (hidden files aside)."""
    if path.is_file():
        return remembered_sha256(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        digest.update(f"{rel.as_posix()}\0{remembered_sha256(f)}\n".encode())
    return digest.hexdigest()


def remembered_sha256(path: Path) -> str:
    """A file's sha256, remembered across runs (a model of tens of GB takes minutes to
    read) in the cache's sha256.json, by its device, inode, size and modification time:
    a file written again, or replaced, is read again."""
    memo_path = cache_dir().parent / "sha256.json"
    st = path.stat()
    key, version = str(path.resolve()), [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    memo = _read_memo(memo_path)
    entry = memo.get(key)
    if isinstance(entry, dict) and entry.get("version") == version:
        sha = entry.get("sha256")
        if isinstance(sha, str) and len(sha) == 64:
            return sha
    sha = file_sha256(path)
    memo = {k: v for k, v in memo.items() if Path(k).exists()}  # files since deleted go
    memo[key] = {"version": version, "sha256": sha}
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo_path, json.dumps(memo, indent=1).encode())
    except OSError:
        pass  # a cache that cannot be written costs the next run one more read
    return sha


def _read_memo(path: Path) -> dict:
    """sha256.json's entries; none if it is missing or not a JSON object."""
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def connect(host: str, port: int, timeout: float = HANDSHAKE_TIMEOUT) -> socket.socket:
    """A control connection to the worker at host:port."""
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise InferError(f"worker {host}:{port}: cannot connect ({e.strerror or e})") from None


def listen(host: str, port: int) -> socket.socket:
    """The worker's listening socket, on `host` only."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(4)
    except OSError as e:
        raise InferError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock
