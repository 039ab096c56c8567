"""Compiled programs from a peer: a host that joins a running job takes a member's compiled
programs instead of compiling its own, when their machines agree.

Why. A host that starts on an empty disk (a new spot machine, a wiped one, a new host id)
spends most of its start compiling (configs/tiny.py on 0.36 of a core: about 15 of its
22 s to join), while every member already holds the same programs in its compilation cache
(compile_cache.py): JAX's entries, and the inner step and init kept whole. So every live
host serves its cache (`Offer`), at an address it registers with the coordinator
(`wire.epoch.Member.programs`), and a joiner asks the members for it (`fetch`) before it
builds anything, lowest member first, then builds as a host whose cache was never wiped.

What is taken, and when it is refused. The joiner sends its machine's digest: jax's,
jaxlib's and Python's versions, the backend, the CPU's model and instruction sets, the
devices and process, jax's config and the JAX_/XLA_ environment (`compile_cache`'s machine
key, where the cache's own path is not a part). A member whose digest differs sends
nothing: XLA:CPU code built for instructions this CPU lacks must not run here. Every file
comes with its sha256, checked before it is written. Then each entry passes the tests of a
local one when the build loads it: JAX's are keyed by the program itself (a program that
differs misses), and a program kept whole is used only while every Python module it was
built from is, by path, size and modification time, the same file here (hosts started from
one image), else compiled as before. A file this host already has is neither sent nor
replaced.

Who may ask. The server listens with the join token's key (wire/sealed.py: CURVE, a key
only token holders can compute; every request and answer MACed as the coordinator's are):
as the workdir and the wire, these files are machine code this process runs, and are
trusted as the token's holders are. Without a token (loopback, --insecure) anyone who
reaches the port may read them, as they may join the job.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
import threading
import time

import zmq

from diloco_jax import compile_cache
from diloco_jax.membership import protocol
from diloco_jax.runtime import security
from diloco_jax.wire import epoch as epoch_lib
from diloco_jax.wire import sealed

C2S, S2C = b"diloco_jax programs request|", b"diloco_jax programs answer|"
MAX_BYTES = 1 << 30  # at most this much is sent: a larger cache is compiled instead
MAX_HAVE = 256  # names of files a joiner already has, at most, in a request
POLL_MS = 100


def _key(token: security.JoinToken | None) -> bytes:
  # not the coordinator's key: a message of one service is never one of the other's
  if token is None:
    return protocol.key_for(None) + b"|programs"
  return token.derive_key("programs v1")


def machine_digest() -> str:
  """This machine's part of every program's key (`compile_cache`'s), hashed."""
  facts = json.dumps(compile_cache.machine(), sort_keys=True, default=repr)
  return hashlib.sha256(facts.encode()).hexdigest()


def _files(cache: str) -> list[str]:
  """The entries of the cache directory `cache`, relative to it: JAX's and the programs
  kept whole (not the temporary files of a write, nor another host's directory)."""
  out = []
  for folder in ("", "executables"):
    try:
      names = sorted(os.listdir(os.path.join(cache, folder)))
    except OSError:
      continue
    out += [os.path.join(folder, n) for n in names if not n.startswith(".tmp")
            and os.path.isfile(os.path.join(cache, folder, n))]
  return out


class Offer:
  """Serves this host's compilation cache to the job's joiners from a thread of its own, on
  a free port of `ip`; `address` is what it registers. `take` (a joiner) fetches the
  members' into it; `close` ends it."""

  def __init__(self, ip: str, token: security.JoinToken | None, cache: str):
    self.cache, self._key, self._token = cache, _key(token), token
    self.taken: dict | None = None  # what `take` wrote: host, files, bytes, seconds
    self._digest: str | None = None  # computed on the first request: jax is up by then
    self._ctx = zmq.Context.instance()
    self._sock = self._ctx.socket(zmq.ROUTER)
    self._sock.setsockopt(zmq.LINGER, 0)
    self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REQUEST + 64)
    sealed.listen(self._sock, self._key if token is not None else None)
    host = f"[{ip}]" if ":" in ip else ip
    port = self._sock.bind_to_random_port(f"tcp://{host}")
    self.address = f"{host}:{port}"
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, name="programs", daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    while not self._stop.is_set():
      try:
        if not self._sock.poll(POLL_MS):
          continue
        msg = self._sock.recv_multipart(zmq.NOBLOCK)
      except zmq.ZMQError:
        return  # closed
      route, frames = msg[:2], msg[2:]
      try:
        answer = self._answer(protocol.verify(self._key, C2S, frames,
                                              protocol.MAX_REQUEST)) if len(route) == 2 else None
      except Exception:  # noqa: BLE001 -- no request may end the server: it is dropped
        answer = None
      if answer is None:
        continue
      try:
        self._sock.send_multipart(route + answer, zmq.NOBLOCK, copy=False)
      except zmq.ZMQError:
        pass  # the joiner is gone

  def _answer(self, req: dict) -> list | None:
    nonce = protocol.text(req, "nonce")
    digest, have = protocol.text(req, "machine"), req.get("have", [])
    if protocol.text(req, "op") != "programs" or not isinstance(have, list):
      return None
    if self._digest is None:
      self._digest = machine_digest()
    files, blobs, total = [], [], 0  # each file a frame of its own: nothing copied twice
    if digest == self._digest:
      for name in _files(self.cache):
        if name in have:
          continue
        try:
          with open(os.path.join(self.cache, name), "rb") as f:
            data = f.read()
        except OSError:
          continue  # pruned meanwhile
        if total + len(data) > MAX_BYTES:
          break
        total += len(data)
        files.append([name, len(data), hashlib.sha256(data).hexdigest()])
        blobs.append(data)
    body = {"op": "programs", "nonce": nonce, "machine": self._digest, "files": files}
    return [*protocol.sign(self._key, S2C, body), *blobs]

  def take(self, epoch: epoch_lib.Epoch, timeout_s: float = 30.0) -> dict | None:
    """A joiner: the programs it lacks, from the members of `epoch` (`fetch`), into its
    own cache, before anything compiles; what was taken (also `taken`), or None."""
    self.taken = fetch(epoch, self._token, self.cache, timeout_s)
    return self.taken

  def close(self) -> None:
    self._stop.set()
    self._thread.join()
    self._sock.close(linger=0)


def fetch(epoch: epoch_lib.Epoch, token: security.JoinToken | None, cache: str,
          timeout_s: float = 30.0) -> dict | None:
  """Asks the members of `epoch` that offer programs, lowest first, for those this host
  lacks, and writes the first answer's files into `cache`: what was taken (host, files,
  bytes, seconds), or None where no member had any for this machine (or none answered)."""
  t0, cache = time.perf_counter(), os.path.normpath(cache)
  digest, key = machine_digest(), _key(token)
  have = _files(cache)[:MAX_HAVE]
  for member in epoch.members:
    if not member.programs:
      continue
    files, blobs = _ask(member.programs, key, token is not None, digest, have, timeout_s)
    if not files:
      continue
    written = _write(cache, files, blobs)
    return {"host": member.host, "files": written, "bytes": sum(len(b) for b in blobs),
            "seconds": round(time.perf_counter() - t0, 3)}
  return None


def _ask(address: str, key: bytes, keyed: bool, digest: str, have: list[str],
         timeout_s: float) -> tuple[list, list[bytes]]:
  """One member's answer: its files' [name, size, sha256] and their bytes, a frame each;
  nothing where it did not answer in `timeout_s`, or its answer fails a check."""
  ctx = zmq.Context.instance()
  sock = ctx.socket(zmq.REQ)
  sock.setsockopt(zmq.LINGER, 0)
  sock.setsockopt(zmq.MAXMSGSIZE, MAX_BYTES)  # a frame over it cuts the connection
  sealed.connect(sock, key if keyed else None)
  nonce = secrets.token_hex(16)
  try:
    sock.connect(epoch_lib.endpoint(address))
    sock.send_multipart(protocol.sign(key, C2S, {"op": "programs", "nonce": nonce,
                                                 "machine": digest, "have": have}))
    if not sock.poll(int(timeout_s * 1000)):
      return [], []
    frames = sock.recv_multipart()
    body = protocol.verify(key, S2C, frames[:2])
    files = body.get("files")
    if (protocol.text(body, "nonce") != nonce or protocol.text(body, "machine") != digest
        or not isinstance(files, list) or len(files) != len(frames) - 2):
      return [], []
    return files, frames[2:]
  except (zmq.ZMQError, protocol.BadRequest, security.SecurityError):
    return [], []
  finally:
    sock.close(linger=0)


def _write(cache: str, files: list, blobs: list[bytes]) -> int:
  """Writes each file whose bytes (its frame in `blobs`) have its size and sha256 and that
  this host lacks; how many."""
  written = 0
  for entry, blob in zip(files, blobs):
    name, size, sha = entry if isinstance(entry, list) and len(entry) == 3 else ("", -1, "")
    path = os.path.normpath(os.path.join(cache, str(name)))
    folder = os.path.dirname(path)
    if (size != len(blob) or folder not in (cache, os.path.join(cache, "executables"))
        or os.path.basename(path).startswith(".") or os.path.exists(path)
        or hashlib.sha256(blob).hexdigest() != sha):
      continue
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".tmp-",
                                     delete=False) as f:
      f.write(blob)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)
    written += 1
  return written
