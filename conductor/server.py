"""The Conductor process: the public ``Inference`` service and the internal ``Registry``
service, embeddable (``build(config)``, a ``runtime.service.Service``) or run (``serve``).

This module only parses, authenticates, admits and maps typed refusals to gRPC statuses
(with the reason and a retry hint in the trailers); a request's life is
``conductor.lifecycle``'s, routing ``conductor.core``'s, the cluster state
``conductor.cluster``'s. The steps and their statuses: docs/architecture.md, "The request
lifecycle"; who may call what: "Who may call what".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError

import engine
from clusterstate.log import entry
from conductor.admission import Admission, TenantLimits
from conductor.apikeys import ApiKey, ApiKeys
from conductor.clock import Clock, SystemClock
from conductor.cluster import Cluster
from conductor.config import ConductorConfig
from conductor.core import ConductorCore
from conductor.grpc_dispatch import GrpcDispatcher
from conductor.lifecycle import Aborted, Refused, RequestLife
from conductor.metrics import ConductorMetrics
from conductor.requests import LiveRequests
from conductor.routing import PolicyContext, make_policy
from conductor.shared_state import SharedState, open_state
from conductor.validation import ValidRequest, validate
from costmodel import CalibrationError, CostModels, load_models
from costmodel.builtin import tiny_cpu_estimate
from proto import inference_pb2 as pb
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import CONDUCTOR, AuthError, Member, Need, current_principal, derive, refuse, worker_principal
from runtime.grpc_server import follow_readiness, start_server
from runtime.logs import Throttled
from runtime.metrics import start_metrics
from runtime.service import ServiceBase, serve_until_signal
from runtime.settings import parse_config

log = logging.getLogger(__name__)
REFUSALS = Throttled(log)  # each refused request logged once, bounded under floods


def load_costs(config: ConductorConfig) -> CostModels:
    """The calibration named by the config, or the built-in estimate (with a warning).
    ``CalibrationError`` naming the file when it is missing, corrupt or of the wrong format."""
    if config.calibration:
        costs = load_models(config.calibration)
        log.info("cost models from %s (%s grid, model %s, %s, %d threads)", config.calibration, costs.info.grid,
                 costs.info.model_fingerprint[:12], costs.info.device, costs.info.torch_threads)
        return costs
    log.warning("no --calibration given: the %s policy uses the built-in estimate for the tiny model on CPU; "
                "run `tidekv calibrate` for this machine and model", config.policy)
    return tiny_cpu_estimate()


def public_auth(config: ConductorConfig) -> ApiKeys | None:
    """The API keys of ``--api-keys`` (ValueError naming a bad file); None, with a loud
    warning, under ``--insecure-no-auth``; ValueError when neither is given."""
    if config.api_keys:
        return ApiKeys(config.api_keys)
    if not config.insecure_no_auth:
        raise ValueError("the public endpoint needs --api-keys FILE (`tidekv apikey add --file FILE --tenant T`), "
                         "or --insecure-no-auth to serve anyone who connects, trusting their tenant field")
    log.warning("INSECURE: --insecure-no-auth: the public endpoint takes no API key and trusts every request's "
                "tenant; any client can use and probe any tenant's cache")
    return None


def calibration_check(config: ConductorConfig, costs: CostModels):
    """A registration check: a worker serving another model than the calibration's is refused."""
    expected = costs.info.model_fingerprint

    def check(info: ipb.WorkerInfo) -> str | None:
        if config.calibration and expected and info.model_fingerprint != expected:
            return (f"calibration {config.calibration} was made for model {expected}, but worker "
                    f"{info.worker_id} serves {info.model_fingerprint}: recalibrate with `tidekv calibrate`")
        return None

    return check


NEEDS = {"/tidekv.v1.Inference/Generate": Need.OPEN,  # API keys, checked by the servicer
         "/tidekv.v1.Registry/Register": Need.MEMBER, "/tidekv.v1.Registry/Heartbeat": Need.SESSION,
         "/tidekv.v1.Registry/Deregister": Need.SESSION,
         "/tidekv.v1.Registry/Workers": Need.MEMBER, "/tidekv.v1.Registry/State": Need.MEMBER}


class InferenceService:
    """``api_keys`` None: no authentication, the request's tenant is trusted (--insecure-no-auth)."""

    def __init__(self, config: ConductorConfig, core: ConductorCore, dispatcher: GrpcDispatcher,
                 admission: Admission, metrics: ConductorMetrics, api_keys: ApiKeys | None, live: LiveRequests):
        self.config, self.core, self.dispatcher, self.admission, self.metrics = (
            config, core, dispatcher, admission, metrics)
        self.api_keys = api_keys
        self.live = live
        self.cfg = engine.load_config(config.model)
        self.tokenizer = engine.load_tokenizer(config.model)
        self.limits = config.limits
        self._seq = itertools.count()

    def add_to(self, server: grpc.Server) -> None:
        """Serves Generate with the request left as bytes, so that a malformed message is the
        servicer's INVALID_ARGUMENT rather than gRPC's INTERNAL."""
        handler = grpc.unary_stream_rpc_method_handler(
            self.GenerateRaw, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tidekv.v1.Inference",
                                                                              {"Generate": handler}),))

    def GenerateRaw(self, raw: bytes, context: grpc.ServicerContext):
        tenant = self._authenticate(context)
        try:
            request = pb.GenerateRequest.FromString(raw)
        except DecodeError:
            self.metrics.refused("", "invalid", "invalid_argument")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "malformed GenerateRequest: not a valid message, or text that is not UTF-8")
        yield from self.Generate(request, context, tenant)

    def _authenticate(self, context: grpc.ServicerContext) -> ApiKey | None:
        if self.api_keys is None:
            return None
        try:
            return self.api_keys.authenticate(context.invocation_metadata())
        except AuthError as e:
            refuse(context, e, "Generate")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext, key: ApiKey | None = None):
        valid = self._validate(request, context, key)
        client_left_s = context.time_remaining()
        deadline_s = min(valid.deadline_s, client_left_s if client_left_s is not None else math.inf)
        # Admission is shared by the key's tenant (its sub-tenants count as it), under its limits.
        share = (key.tenant, key.limits) if key is not None else (valid.tenant, TenantLimits())
        gone = threading.Event()  # the call ended (its client left): a queued request gives up its place

        def client_left() -> None:
            gone.set()
            self.admission.wake()

        if not context.add_callback(client_left):  # (False: the call has ended already)
            client_left()
        if not self._admit(request, valid, deadline_s, share, context, gone):
            return
        claim = self.live.claim(valid.tenant, request.request_id, failover=request.failover or bool(valid.resumed))
        if claim is None:
            self.metrics.refused(valid.tenant, "rejected", "duplicate_id")
            self.admission.leave(share[0])
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already in flight "
                                                          f"for this tenant; give each request its own id")
        life = RequestLife(self.core, self.dispatcher, self.tokenizer, valid, claim.request_id, next(self._seq),
                           self.config.max_prefill_attempts, self.metrics,
                           max_migrations=self.config.max_decode_migrations,
                           prefill_timeout_s=self.config.prefill_timeout_s, client_deadline_s=context.time_remaining(),
                           client_request_id=claim.client_request_id, live_key=claim.live_key)
        if not context.add_callback(life.cancel):  # the client left while the request was admitted
            life.cancel()
        try:
            yield from life.run()
        except Refused as e:
            self._refuse(valid.tenant, life.request_id, e.reason, str(e), e.code, f"{e.retry_after_s:g}", context)
        except Aborted as e:  # DEADLINE_EXCEEDED after work began; the lifecycle reported the outcome
            context.abort(e.code, str(e))
        finally:
            self.live.release(claim)
            self.admission.leave(share[0])

    def _validate(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
                  key: ApiKey | None) -> ValidRequest:
        """The request checked (INVALID_ARGUMENT naming the field), its tenant the credential's."""
        try:
            valid = validate(request, self.cfg, self.tokenizer, self.limits)
        except ValueError as e:
            self.metrics.refused(request.tenant, "invalid", "invalid_argument")
            REFUSALS.log(logging.INFO, "invalid", "request %s from %s refused: INVALID_ARGUMENT: %s",
                         request.request_id or "(no id)", context.peer(), e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if key is None:
            return valid
        try:  # the tenant, and so the cache salt, comes from the credential
            return dataclasses.replace(valid, tenant=key.tenant_for(request.tenant))
        except AuthError as e:
            refuse(context, e, f"Generate as tenant {request.tenant!r}")

    def _admit(self, request: pb.GenerateRequest, valid: ValidRequest, deadline_s: float,
               share: tuple[str, TenantLimits], context: grpc.ServicerContext, gone: threading.Event) -> bool:
        """A running slot for the tenant's share, waited for until the deadline or
        ``--max-queue-wait-s``, whichever is sooner; refused with the reason otherwise. False
        when the call ended while the request waited: there is nothing to answer."""
        refusal = self.admission.try_enter(min(deadline_s, self.config.max_queue_wait_s), *share, gone=gone)
        if refusal is None:
            return True
        if refusal.kind == "gone":  # the call has ended: its gRPC deadline passed, or the client left
            left_s = context.time_remaining()
            expired = left_s is not None and left_s <= 0
            self.metrics.refused(valid.tenant, *(("rejected", "deadline") if expired else ("cancelled", "client_gone")))
            return False
        late = deadline_s <= self.config.max_queue_wait_s and refusal.kind == "waited"
        reason = "deadline" if late else "queue_full" if refusal.kind == "waited" else refusal.kind
        self._refuse(valid.tenant, request.request_id or "(no id)", reason,
                     refusal.message + (" before the request's deadline" if late else ""),
                     grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.RESOURCE_EXHAUSTED, "1", context)

    def _refuse(self, tenant: str, request_id: str, reason: str, message: str, code: grpc.StatusCode,
                retry_after_s: str, context: grpc.ServicerContext) -> None:
        """Counts, logs (throttled) and ends the call with ``code``, the reason and a retry hint
        in its trailers (a client retries elsewhere or later by them)."""
        self.metrics.refused(tenant, "rejected", reason)
        REFUSALS.log(logging.INFO, f"rejected:{reason}", "request %s rejected (%s): %s", request_id, reason, message)
        context.set_trailing_metadata((("retry-after-s", retry_after_s), ("reject-reason", reason)))
        context.abort(code, message)


class RegistryService(igrpc.RegistryServicer):
    """``on_lost(worker_ids)``: gives up the calls in flight to workers that left."""

    def __init__(self, cluster: Cluster, heartbeat_interval_s: float,
                 on_lost: Callable[[Sequence[str]], None] = lambda ids: None):
        self.cluster = cluster
        self.heartbeat_interval_s = heartbeat_interval_s
        self.on_lost = on_lost

    def Register(self, request: ipb.RegisterRequest, context: grpc.ServicerContext) -> ipb.RegisterResponse:
        reason = self.cluster.register(request.info, current_principal(context))
        if reason is not None:
            log.warning("refused Register of %s from %s: %s", request.info.worker_id, context.peer(), reason)
        return ipb.RegisterResponse(accepted=reason is None, reason=reason or "",
                                    heartbeat_interval_s=self.heartbeat_interval_s)

    def Heartbeat(self, request: ipb.HeartbeatRequest, context: grpc.ServicerContext) -> ipb.HeartbeatResponse:
        principal = current_principal(context)
        if principal != worker_principal(request.worker_id):
            refuse(context, AuthError(grpc.StatusCode.PERMISSION_DENIED,
                                      f"{principal} may not heartbeat for {request.worker_id}"), "Heartbeat")
        try:
            known = self.cluster.heartbeat(request.worker_id, request.load, list(request.events), request.seq)
        except ValueError as e:  # a malformed load or event from the worker
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return ipb.HeartbeatResponse(known=known)

    def Deregister(self, request: ipb.DeregisterRequest, context: grpc.ServicerContext) -> ipb.DeregisterResponse:
        principal = current_principal(context)
        if principal != worker_principal(request.worker_id):
            refuse(context, AuthError(grpc.StatusCode.PERMISSION_DENIED,
                                      f"{principal} may not deregister {request.worker_id}"), "Deregister")
        removed = self.cluster.deregister(request.worker_id, request.reason or "deregistered")
        if removed:
            self.on_lost([request.worker_id])
        return ipb.DeregisterResponse(removed=removed)

    def Workers(self, request: ipb.WorkersRequest, context: grpc.ServicerContext) -> ipb.WorkersResponse:
        resp = ipb.WorkersResponse()
        for info, load in self.cluster.alive():
            resp.workers.append(info)
            resp.loads.append(load)
        return resp

    def State(self, request: ipb.StateRequest, context: grpc.ServicerContext) -> ipb.StateResponse:
        state, log_ = self.cluster.state, self.cluster.log
        blocks, num_blocks = state.blocks_digest()
        delays = sorted(log_.delays_s)
        quantile = (lambda q: delays[min(len(delays) - 1, int(q * len(delays)))]) if delays else (lambda q: 0.0)
        return ipb.StateResponse(replica_id=log_.replica_id, seq=log_.seq, digest=state.digest(),
                                 blocks_digest=blocks, num_blocks=num_blocks, lag_s=min(log_.lag_s, 1e9),
                                 shared=log_.shared, delay_p50_s=quantile(0.5), delay_p99_s=quantile(0.99),
                                 num_delays=len(delays))


def build_core(config: ConductorConfig, cluster: Cluster, costs: CostModels, clock: Clock,
               shared: SharedState | None = None) -> ConductorCore:
    """The core over ``cluster``; with a shared state, its transitions go to the other replicas."""
    policy = make_policy(config.policy, PolicyContext(config.routing, costs))
    share = None
    if shared is not None and shared.shared:
        log_, origin = shared.log, shared.log.replica_id
        share = lambda change: log_.share(entry(origin, pending=change))  # noqa: E731
    core = ConductorCore(cluster, policy, config.slos, clock, share=share,
                         block_key_secret=derive(cluster.member.secret, "block-keys"))
    if shared is not None:
        shared.applier.on_overlay = core.apply_overlay
    return core


class Conductor(ServiceBase):
    """The Conductor as an embeddable ``runtime.service.Service``: built from its config, it
    installs no signal handler and reads no environment. ``start`` loads the cost models
    (``CalibrationError`` naming a bad file), opens the index and serves ``Inference`` and
    ``Registry`` on ``config.host:config.port``; a reaper thread drops silent workers."""

    role = "conductor"

    def __init__(self, config: ConductorConfig, clock: Clock | None = None):
        super().__init__()
        self.config = config
        self._clock = clock or SystemClock()
        self.cluster: Cluster | None = None

    def _start(self) -> None:
        config = self.config
        costs = load_costs(config)
        member = Member.from_config(config.cluster_secret_file, CONDUCTOR, config.tls)
        api_keys = public_auth(config)
        self.shared = shared = open_state(config, member.secret)
        self.cluster = cluster = Cluster(shared.state, shared.log, member, shared.keys,
                                         check=calibration_check(config, costs))
        core = build_core(config, cluster, costs, self._clock, shared)
        shared.log.start()
        self._closing.callback(shared.log.close)
        metrics = ConductorMetrics.for_config(config)
        admission = Admission(config.admission)
        dispatcher = GrpcDispatcher(cluster, config.decode_stall_timeout_s or math.inf, config.reservation_renew_s)
        live = LiveRequests(derive(member.secret, "request-ids"), shared.log.replica_id, core.replicas)
        inference = InferenceService(config, core, dispatcher, admission, metrics, api_keys,
                                     live)
        metrics.watch(cluster, admission)
        registry = RegistryService(cluster, config.heartbeat_interval_s, dispatcher.workers_lost)
        self._running = start_server(
            [inference.add_to, lambda s: igrpc.add_RegistryServicer_to_server(registry, s)],
            ["tidekv.v1.Inference", "tidekv.v1.Registry"], config.host, config.port,
            max_workers=config.max_running + config.max_queued + 32,
            interceptors=[member.interceptor(NEEDS, cluster.session_key_for, shared.nonces())], tls=config.tls,
            max_receive_bytes=config.max_request_bytes,
        )
        self._closing.callback(self._running.stop, 0)
        self.metrics = start_metrics(config.host, config.metrics_port)
        self._closing.callback(self.metrics.stop)
        self._closing.callback(follow_readiness(self._running, self.ready))
        self._start_reaper(shared, cluster, core, dispatcher)

    def _start_reaper(self, shared: SharedState, cluster: Cluster, core: ConductorCore,
                      dispatcher: GrpcDispatcher) -> None:
        """Every quarter of the lease: a worker that went silent (dead, or stopped) leaves the
        registry's view and its in-flight calls are given up (within 1.25 leases), expired
        records are purged, and silent replicas' requests leave the overlay."""
        stop = threading.Event()

        def reap() -> None:
            alive = set(shared.state.alive_ids())
            while not stop.wait(self.config.worker_ttl_s / 4):
                now_alive = set(shared.state.alive_ids())
                lost = sorted(alive - now_alive)
                alive = now_alive
                for worker_id in lost:
                    log.warning("worker %s stopped heartbeating; out of the registry (its record and blocks are "
                                "purged if it stays silent)", worker_id)
                dispatcher.workers_lost(lost)
                cluster.reap_expired()
                for replica in core.replicas.sweep(self._clock.now()):
                    log.warning("Conductor replica %s went silent; its requests leave the overlay", replica)

        reaper = threading.Thread(target=reap, name="reaper", daemon=True)
        reaper.start()
        self._closing.callback(reaper.join, 5)
        self._closing.callback(stop.set)

    def ready(self) -> bool:
        """Serving, not draining, caught up with the cluster's log, and at least one live
        worker of each role."""
        if self._running is None or self._draining or self.cluster is None or not self.cluster.log.ready:
            return False
        roles = {info.role for info, _ in self.cluster.alive()}
        return {ipb.WORKER_ROLE_PREFILL, ipb.WORKER_ROLE_DECODE} <= roles

    def drain(self, timeout_s: float) -> None:
        """NOT_SERVING, then the server refuses new calls and in-flight Generate streams finish
        (up to ``timeout_s``) on the workers that hold them."""
        if self._running is None:
            return
        self._draining = True
        self._running.stop(timeout_s)


def build(config: ConductorConfig, clock: Clock | None = None) -> Conductor:
    """The Conductor of ``config``, not started (``clock``: injectable for tests)."""
    return Conductor(config, clock)


def serve(argv: list[str] | None = None) -> None:
    """``tidekv serve --role conductor``: flags and ``TIDEKV_*`` -> build -> serve until SIGTERM/SIGINT."""
    config = parse_config(ConductorConfig, argv, prog="tidekv serve --role conductor")

    def announce(c: Conductor) -> None:
        metrics = f", metrics on {c.metrics.address}" if c.metrics.address else ""
        print(f"tidekv conductor serving on {c.address} (policy {config.policy}, index {config.index}{metrics})",
              flush=True)

    try:
        serve_until_signal(build(config), config.drain_timeout_s, announce)
    except (CalibrationError, ValueError) as e:
        raise SystemExit(f"tidekv conductor: {e}") from e
