"""P2pConnector: disaggregated prefill and decode. A prefill instance computes a prompt, holds its blocks when the
request asked for it (kv_transfer_params {"do_remote_decode": true}) and answers with where they are; a decode instance
given those parameters ({"do_remote_prefill": true, ...}) pulls the blocks it does not already have in its prefix
cache straight from the prefill instance's ranks, then tells the prefill instance to give them back. No shared
filesystem: ZMQ over TCP (block_transport.py).

Addresses: the prefill instance's engine listens for "done with these blocks" at kv_host:kv_port, its rank r serves
blocks at kv_host:kv_port + 1 + r. A decode instance's ranks report each pull to its engine on a loopback port of
its own. A hold nobody gives back ends after kv_lease_seconds. A decode instance pulls only from the instances it
trusts (trusted_producers; by default those on its loopback), only for a prompt whose digest matches its own, and
only into an instance of the same layout (checked on the data); anything else, and any pull that fails, ends the
load as failed: the scheduler then computes the prompt itself (kv_load_failure_policy "recompute") or ends the
request ("fail").
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import queue
import secrets
import socket as socket_module
import threading
import time
import uuid
from array import array
from dataclasses import dataclass, field

import msgspec
import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import KVConnectorMetadata, KVPull, SchedulerOutput
from pagedserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pagedserve.kv_transfer.block_transport import BlockServer, TransferError, bind, pull_blocks
from pagedserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# How long a rank waits for each answer of a prefill instance's rank: one that does not answer is gone, and the
# request computes its prompt (or ends) rather than wait longer.
PULL_TIMEOUT_S = 10.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_PULLED_REMEMBERED = 65536


def prompt_digest(token_ids: list[int]) -> str:
    """What both instances must agree a request's prompt is, before KV computed for one is used for the other."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


class _LoadReport(msgspec.Struct, array_like=True):
    request_id: str
    rank: int
    ok: bool
    bytes: int
    seconds: float
    error: str = ""


class _Release(msgspec.Struct, array_like=True):
    request_id: str
    token: str
    tokens: int  # prompt tokens whose KV the decode instance read (0: it could not)
    bytes: int


@dataclass
class _Remote:
    """A prefill instance's kv_transfer_params, checked."""

    engine_id: str
    request_id: str
    host: str
    port: int
    token: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str
    world_size: int

    @classmethod
    def of(cls, params: dict) -> _Remote:
        try:
            remote = cls(str(params["remote_engine_id"]), str(params["remote_request_id"]), str(params["remote_host"]),
                         int(params["remote_port"]), str(params["remote_token"]), [int(b) for b in params["remote_block_ids"]],
                         int(params["remote_num_tokens"]), str(params["remote_prompt_digest"]), int(params["remote_world_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"kv_transfer_params lack or mistype {exc}") from None
        return remote

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Load:
    remote: _Remote
    num_tokens: int  # prompt tokens whose KV it moves (those beyond the decode instance's prefix-cache hit)
    started: float
    reports: list[_LoadReport] = field(default_factory=list)


class P2pScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig) -> None:
        transfer = config.kv_transfer
        self.transfer, self.block_size, self.world_size = transfer, config.block_size, config.world_size
        self.engine_id = transfer.engine_id or f"pagedserve-{uuid.uuid4().hex[:12]}"
        self.host, self.port = transfer.p2p_setting("kv_host"), transfer.p2p_setting("kv_port")
        self.lease_s = float(transfer.p2p_setting("kv_lease_seconds"))
        trusted = transfer.p2p_setting("trusted_producers")
        self.trusted = None if trusted is None else set(trusted)
        self.received_bytes = self.sent_bytes = self.load_failures = 0
        self._transfer_seconds: list[float] = []
        self._context = zmq.Context.instance()
        self._releases_in = self._reports_in = None
        if transfer.saves:  # decode instances say here when they are done with a hold's blocks
            self._releases_in = self._bind_pull(f"tcp://{self.host}:{self.port}")
        self.notify_address = ""
        if transfer.loads:
            self._reports_in = self._bind_pull("tcp://127.0.0.1:*")
            self.notify_address = self._reports_in.getsockopt_string(zmq.LAST_ENDPOINT)
        self._release_out: dict[str, zmq.Socket] = {}  # prefill instance's address -> a socket to it
        # A prefill instance's side: request id -> (token, lease end) of each hold; holds and releases for the workers.
        self._holds: dict[str, tuple[str, float]] = {}
        self._new_holds: list[tuple[str, str, list[int]]] = []
        self._released: list[str] = []
        self._worker_releases: list[str] = []
        # A decode instance's side.
        self._loads: dict[str, _Load] = {}
        self._new_pulls: list[KVPull] = []
        self._finished_loads: list[tuple[str, bool]] = []
        self._checked: dict[str, _Remote] = {}  # waiting requests' prefill instances, checked, until they load
        self._failed: set[str] = set()  # requests that compute their prompt themselves
        # (engine, request) of holds read or given up, most recent last: their blocks are given back. Bounded: a request
        # that outlives many later ones and is preempted pulls again, fails, and computes its prompt.
        self._pulled: dict[tuple[str, str], None] = {}

    def _bind_pull(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        bind(socket, address)
        return socket

    # ---- a decode instance: loads ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._remote_of(request)
        if remote is None:
            return 0, False
        # Every prompt token the prefill instance computed beyond the local hit: the scheduler computes the last one
        # again once they arrived, for the logits of the first output token.
        return max(0, request.num_prompt_tokens - num_computed_tokens), True

    def _remote_of(self, request: Request) -> _Remote | None:
        """The prefill instance holding the request's prompt KV, where it may be pulled from; None otherwise (a refused
        one counts as a failed load). Checked once: a request the cache has no room for yet is asked about every step."""
        params = request.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.transfer.loads or request.request_id in self._failed:
            return None
        remote = self._checked.get(request.request_id)
        if remote is not None:
            return remote if (remote.engine_id, remote.request_id) not in self._pulled else None
        try:
            remote = _Remote.of(params)
            if (remote.engine_id, remote.request_id) in self._pulled:
                return None  # another sample of the request pulled it: its blocks are in the prefix cache, or gone
            self._check(remote, request)
        except ValueError as exc:
            logger.warning("request %s computes its prompt: its KV cannot be loaded: %s", request.request_id, exc)
            self._fail(request.request_id)
            return None
        if request.skips_prefix_cache:  # prompt logprobs: every position is computed here; the hold is not needed
            self._give_up(remote)
            return None
        self._checked[request.request_id] = remote
        return remote

    def _give_up(self, remote: _Remote) -> None:
        """Tell a trusted prefill instance its hold will not be read from here."""
        self._remember_pulled(remote)
        self._release(remote, 0, 0)

    def _remember_pulled(self, remote: _Remote) -> None:
        self._pulled[(remote.engine_id, remote.request_id)] = None
        if len(self._pulled) > _PULLED_REMEMBERED:
            del self._pulled[next(iter(self._pulled))]

    def _check(self, remote: _Remote, request: Request) -> None:
        if self.trusted is None and remote.host not in _LOOPBACK or self.trusted is not None and remote.address not in self.trusted:
            raise ValueError(f"the prefill instance at {remote.address} is not among the trusted producers")
        if remote.prompt_digest != prompt_digest(request.prompt_token_ids) or remote.num_tokens != request.num_prompt_tokens:
            raise ValueError("the prefill instance computed another prompt")
        if remote.world_size != self.world_size:
            raise ValueError(f"the prefill instance has {remote.world_size} ranks, this one {self.world_size}")
        if len(remote.block_ids) < -(-remote.num_tokens // self.block_size):
            raise ValueError("the prefill instance names fewer blocks than its prompt fills")

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        remote = self._checked.pop(request.request_id)
        first, end = request.num_computed_tokens // self.block_size, -(-request.num_prompt_tokens // self.block_size)
        self._loads[request.request_id] = _Load(remote, num_external_tokens, time.monotonic())
        self._new_pulls.append(KVPull(request.request_id, remote.host, remote.port, remote.request_id, remote.token,
                                      remote.block_ids[first:end], block_ids[first:end], self.notify_address))

    def _take_reports(self) -> None:
        while self._reports_in is not None and self._reports_in.poll(0):
            report = msgspec.msgpack.decode(self._reports_in.recv(), type=_LoadReport)
            load = self._loads.get(report.request_id)
            if load is None:
                continue
            load.reports.append(report)
            if len(load.reports) == self.world_size:
                self._load_ended(report.request_id, load)

    def _load_ended(self, request_id: str, load: _Load) -> None:
        del self._loads[request_id]
        ok = all(report.ok for report in load.reports)
        moved = sum(report.bytes for report in load.reports) if ok else 0
        tokens = load.num_tokens if ok else 0
        self._release(load.remote, tokens, moved)  # read, or unreadable: either way the prefill instance may give them back
        if ok:
            self._remember_pulled(load.remote)
            self.received_bytes += moved
            self.received_tokens += tokens
            self._transfer_seconds.append(time.monotonic() - load.started)
        else:
            errors = "; ".join(sorted({report.error for report in load.reports if report.error}))
            logger.warning("request %s: its KV could not be loaded from %s: %s", request_id, load.remote.address, errors)
            self._fail(request_id)
        self._finished_loads.append((request_id, ok))

    def _fail(self, request_id: str) -> None:
        self._failed.add(request_id)
        self.load_failures += 1

    def _release(self, remote: _Remote, tokens: int, moved: int) -> None:
        socket = self._release_out.get(remote.address)
        if socket is None:
            socket = self._release_out[remote.address] = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 1000)  # a prefill instance that is gone holds nothing to give back
            socket.connect(f"tcp://{remote.address}")
        try:
            socket.send(msgspec.msgpack.encode(_Release(remote.request_id, remote.token, tokens, moved)), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("the prefill instance at %s does not take releases: its lease frees its blocks", remote.address)

    def take_finished_loads(self) -> list[tuple[str, bool]]:
        self._take_reports()
        finished, self._finished_loads = self._finished_loads, []
        return finished

    # ---- a prefill instance: holds --------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        failed = request.request_id in self._failed
        self._failed.discard(request.request_id)
        checked = self._checked.pop(request.request_id, None)
        params = request.sampling_params.kv_transfer_params
        if params and params.get("do_remote_prefill") and not failed and request.request_id not in self._loads:
            self._release_unread(request, params, checked)
        if (not params or not params.get("do_remote_decode") or not self.transfer.saves or request.status == RequestStatus.FINISHED_ABORTED
                or request.num_computed_tokens < request.num_prompt_tokens):
            return False, None
        token = secrets.token_hex(16)
        blocks = block_ids[: -(-request.num_prompt_tokens // self.block_size)]
        self._holds.pop(request.request_id, None)  # the same id held before: the new hold goes last, in lease order
        self._holds[request.request_id] = (token, time.monotonic() + self.lease_s)
        self._new_holds.append((request.request_id, token, blocks))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id, "remote_block_ids": blocks, "remote_host": self._advertised_host(),
            "remote_port": self.port, "remote_token": token, "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_digest": prompt_digest(request.prompt_token_ids), "remote_world_size": self.world_size,
        }

    def _release_unread(self, request: Request, params: dict, checked: _Remote | None) -> None:
        """A request that ended before it loaded its KV (aborted while it waited): the prefill instance may give the
        hold back now rather than at its lease's end."""
        try:
            remote = checked or _Remote.of(params)
            if (remote.engine_id, remote.request_id) not in self._pulled:
                if checked is None:
                    self._check(remote, request)
                self._give_up(remote)
        except ValueError:
            pass  # parameters this instance would not have used: nothing to tell anyone

    def _advertised_host(self) -> str:
        return socket_module.gethostname() if self.host in ("0.0.0.0", "*") else self.host

    def _take_releases(self) -> None:
        while self._releases_in is not None and self._releases_in.poll(0):
            try:
                release = msgspec.msgpack.decode(self._releases_in.recv(), type=_Release)
            except msgspec.DecodeError:
                continue
            hold = self._holds.get(release.request_id)
            if hold is not None and hold[0] == release.token:
                self.sent_tokens += release.tokens
                self.sent_bytes += release.bytes
                self._end_hold(release.request_id)
        # Every hold has the same lease, so the oldest (first in the dict) ends first: only expired ones are looked at.
        now = time.monotonic()
        for request_id in [request_id for request_id, _ in itertools.takewhile(lambda hold: hold[1][1] < now, self._holds.items())]:
            logger.warning("request %s: no decode instance pulled its KV within %.0f s; its blocks are given back", request_id,
                           self.lease_s)
            self._end_hold(request_id)

    def _end_hold(self, request_id: str) -> None:
        del self._holds[request_id]
        self._released.append(request_id)
        self._worker_releases.append(request_id)

    def take_released_holds(self) -> list[str]:
        self._take_releases()
        released, self._released = self._released, []
        return released

    # ---- both -----------------------------------------------------------------------------------

    def has_news(self) -> bool:
        self._take_reports()
        self._take_releases()
        return bool(self._finished_loads or self._released)

    def wake_sockets(self) -> list:
        return [socket for socket in (self._releases_in, self._reports_in) if socket is not None]

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                             block_ids_of) -> KVConnectorMetadata:
        metadata = KVConnectorMetadata(holds=self._new_holds, releases=self._worker_releases, pulls=self._new_pulls)
        self._new_holds, self._worker_releases, self._new_pulls = [], [], []
        return metadata

    def step_done(self, metadata: KVConnectorMetadata) -> None:
        pass

    def stats(self) -> dict:
        seconds, self._transfer_seconds = self._transfer_seconds, []
        return super().stats() | {"kv_received_bytes": self.received_bytes, "kv_sent_bytes": self.sent_bytes,
                                  "kv_load_failures": self.load_failures, "kv_transfer_seconds": seconds}

    def close(self) -> None:
        for socket in (self._releases_in, self._reports_in, *self._release_out.values()):
            if socket is not None:
                socket.close(linger=0)


class P2pWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, rank: int) -> None:
        transfer = config.kv_transfer
        self.transfer, self.rank = transfer, rank
        self.address = f"tcp://{transfer.p2p_setting('kv_host')}:{transfer.p2p_setting('kv_port') + 1 + rank}"
        self.server = None
        self.kv_caches: list = []
        self._pulls: queue.Queue[KVPull | None] = queue.Queue()
        self._puller: threading.Thread | None = None

    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches
        if self.transfer.saves:
            self.server = BlockServer(kv_caches, self.address)
        if self.transfer.loads:
            self._puller = threading.Thread(target=self._pull_in_turn, name="kv-puller", daemon=True)
            self._puller.start()

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Serve the new holds and stop serving the released ones (before the forward pass may write their blocks);
        begin the pulls, which end while steps go on."""
        if self.server is not None:
            for request_id, token, block_ids in metadata.holds:
                self.server.hold(request_id, token, block_ids)
            for request_id in metadata.releases:
                self.server.release(request_id)
        for pull in metadata.pulls:
            self._pulls.put(pull)

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        pass  # a hold's blocks are read by the decode instance, from the server's thread

    def _pull_in_turn(self) -> None:
        reports = zmq.Context.instance().socket(zmq.PUSH)
        reports.setsockopt(zmq.LINGER, 1000)
        connected = ""
        while (pull := self._pulls.get()) is not None:
            if pull.notify_address != connected:
                reports.connect(pull.notify_address)
                connected = pull.notify_address
            start, moved, error = time.monotonic(), 0, ""
            try:
                moved = pull_blocks(self.kv_caches, f"tcp://{pull.host}:{pull.port + 1 + self.rank}", pull.remote_request_id,
                                    pull.token, pull.remote_block_ids, pull.block_ids, PULL_TIMEOUT_S)
            except (TransferError, zmq.ZMQError, ValueError, RuntimeError) as exc:
                error = str(exc)
            reports.send(msgspec.msgpack.encode(_LoadReport(pull.request_id, self.rank, not error, moved,
                                                            time.monotonic() - start, error)))
        reports.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._puller is not None:
            self._pulls.put(None)
            self._puller.join(timeout=PULL_TIMEOUT_S)
