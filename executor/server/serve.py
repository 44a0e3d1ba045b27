"""`helm-executor serve`: the daemon process.

Binds the gRPC server (loopback unless told otherwise) with the executor service, standard
health checking (NOT_SERVING until a plan is loaded and warm) and server reflection; logs one
JSON object per line to stderr; loads the plan given on the command line. SIGTERM or SIGINT
drains: new requests get UNAVAILABLE, requests in flight finish within --drain-timeout (then
are aborted), and the process exits 0. A second signal exits at once. A GPU that can run nothing
more (a sticky CUDA error) drains it the same way, and it exits EXIT_DEVICE_LOST for a supervisor
to restart it: no plan can run on that GPU again in this process.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from datetime import datetime, timezone
from pathlib import Path

from executor.errors import HelmError, PlacementError, PlanNotFoundError
from executor.pb import executor_pb2_grpc as pb_grpc
from executor.server.auth import CLIENT, Tokens, is_loopback, server_credentials
from executor.server.daemon import Daemon, caller_share
from executor.server.guard import BODY_TIMEOUT_S, RpcGuard, pool_threads
from executor.server.messages import PlanSource
from executor.server.service import SERVICE_NAME, ExecutorServicer
from planner.errors import PlanError
from planner.plan import Plan, parse_plan
from planner.yamlio import MAX_FILE_BYTES, read_text_file

log = logging.getLogger("helm.serve")

EXIT_DEVICE_LOST = 3


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, and the record's `fields` extra."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
        entry = {"ts": ts.replace("+00:00", "Z"), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def read_startup_plan(plan_path: str) -> tuple[Plan, Path]:
    """(the plan, its checkpoint directory) given on the command line, read and validated once:
    the operator's own file, so it is read from anywhere (within the size limit), unlike
    LoadPlan's paths."""
    try:
        text = read_text_file(Path(plan_path), "plan")
    except PlanError as e:
        raise PlanNotFoundError(str(e)) from None
    try:
        plan = parse_plan(text, f"plan {plan_path}")
    except PlanError as e:
        raise PlacementError(f"invalid plan {plan_path}: {e}") from None
    source = Path(plan.model.source)
    return plan, source.parent if source.suffix == ".json" else source


def start_server(daemon, host: str, port: int, tokens=None, credentials=None, stall_timeout_s: float = 30.0,
                 metrics=None, body_timeout_s: float = BODY_TIMEOUT_S):
    """The gRPC server with the executor, health and reflection services behind the RpcGuard,
    started; TLS with `credentials` (grpc.ssl_server_credentials), else plaintext. (server, port)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    # Twice the admission slots: a stream whose client stopped reading keeps its thread (not its
    # slot) until the stall timeout cuts it off, and must not starve the streams being admitted.
    generate_streams = 2 * (daemon.max_batch + daemon.max_queue)
    threads = pool_threads(generate_streams)
    shares = daemon.max_per_caller < daemon.max_batch + daemon.max_queue  # callers held to a share
    guard = RpcGuard(tokens, generate_streams, body_timeout_s,
                     generate_per_caller=2 * daemon.max_per_caller if shares else None, client_shares=shares)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
        interceptors=(guard,),
        # A backstop for floods far beyond what the lanes serve; the lanes refuse long before it.
        maximum_concurrent_rpcs=4 * threads,
        # so_reuseport off: gRPC turns it on, and a second daemon on a busy port would then share it
        # with the first, each answering some of its calls
        options=(("grpc.max_receive_message_length", max(MAX_FILE_BYTES, daemon.max_prompt_bytes) + (64 << 10)),
                 ("grpc.so_reuseport", 0)))
    pb_grpc.add_ExecutorServiceServicer_to_server(ExecutorServicer(daemon, stall_timeout_s, metrics, tokens), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)

    def on_state(state: str) -> None:
        if state == "draining":
            health_servicer.enter_graceful_shutdown()  # NOT_SERVING for good
            guard.health_status = health_pb2.HealthCheckResponse.NOT_SERVING
            return
        status = health_pb2.HealthCheckResponse.SERVING if state == "serving" \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, status)
        guard.health_status = status  # the answer to a health check beyond its lane

    on_state(daemon.state)
    daemon.on_state_change = on_state
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials is not None \
            else server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind"
        bound = 0
    if not bound:
        raise OSError(f"cannot listen on {address}: the port is in use, or the address is not this machine's")
    server.start()
    server.helm_guard = guard  # serve's drain watches its Generate lane
    return server, bound


def security_of(args):
    """(tokens, TLS credentials) from the serve flags; refuses (ValueError) to expose a daemon
    without both beyond loopback unless --insecure says so."""

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    tokens = Tokens.from_file(args.tokens) if args.tokens else None
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if not is_loopback(args.host) and (tokens is None or credentials is None):
        missing = " and ".join(m for m, have in (("TLS (--tls-cert, --tls-key)", credentials), ("--tokens", tokens))
                               if have is None)
        if not args.insecure:
            raise ValueError(f"--host {args.host} listens beyond loopback without {missing}: anyone who reaches it "
                             "could load plans and read prompts. Add them, or pass --insecure to accept that")
        log.warning("listening beyond loopback without protection (--insecure)",
                    extra={"fields": {"missing": missing, "host": args.host}})
    if args.metrics_port is not None and not is_loopback(args.metrics_host):
        if not args.insecure:  # plain HTTP, no credentials: scrape it on the host, or through a proxy
            raise ValueError(f"--metrics-host {args.metrics_host}: the metrics endpoint has no TLS or authentication; "
                             "keep it on loopback (scrape through a proxy), or pass --insecure to accept that")
        log.warning("metrics beyond loopback without protection (--insecure)",
                    extra={"fields": {"metrics_host": args.metrics_host}})
    return tokens, credentials


def serve(args) -> int:
    configure_logging(args.verbose)
    if args.threads is not None and args.threads < 1:
        log.error("cannot start", extra={"fields": {"error": f"--threads must be >= 1, got {args.threads}"}})
        return 2
    if not args.stall_timeout > 0:
        log.error("cannot start", extra={"fields": {"error": f"--stall-timeout must be > 0, got {args.stall_timeout}"}})
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            log.warning("second signal: exiting now", extra={"fields": {"signal": signal.Signals(signum).name}})
            logging.shutdown()
            os._exit(128 + signum)
        log.info("signal: draining", extra={"fields": {"signal": signal.Signals(signum).name}})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    metrics = None
    try:
        tokens, credentials = security_of(args)
        startup_plan, plan_model_dir = read_startup_plan(args.plan) if args.plan else (None, None)
        model_dir = args.model or plan_model_dir
        clients = sum(1 for _, role in tokens.by_role if role == CLIENT) if tokens else 0
        per_caller = args.max_requests_per_caller or caller_share(args.max_batch, args.max_queue, clients,
                                                                  bool(args.tls_client_ca))
        daemon = Daemon(model_dir, max_batch=args.max_batch, max_queue=args.max_queue, backend=args.kernels,
                        threads=args.threads, plan_dir=args.plan_dir, prefix_cache=args.prefix_cache,
                        gpu_memory_bytes=args.gpu_memory, max_per_caller=per_caller)
        if args.metrics_port is not None:
            from executor.server.metrics import DaemonMetrics

            metrics = DaemonMetrics(daemon)
            metrics_port = metrics.serve_http(args.metrics_host, args.metrics_port)
            log.info("metrics", extra={"fields": {"host": args.metrics_host, "port": metrics_port}})
        server, port = start_server(daemon, args.host, args.port, tokens, credentials, args.stall_timeout, metrics)
    except (HelmError, OSError, OverflowError, RuntimeError, ValueError) as e:
        log.error("cannot start", extra={"fields": {"error": str(e)}})
        if metrics is not None:
            metrics.close()
        return 2
    log.info("listening", extra={"fields": {
        "host": args.host, "port": port, "pid": os.getpid(), "model": str(model_dir),
        "threads": args.threads or "per plan", "tls": credentials is not None,
        "mutual_tls": bool(args.tls_client_ca), "auth": "tokens" if tokens else "none",
        "plan_dir": args.plan_dir}})
    daemon.on_device_lost = stop.set  # drain (its requests have failed) and exit non-zero: restart it
    if args.plan:
        try:
            daemon.load_plan(PlanSource(plan=startup_plan, name=args.plan))
        except HelmError as e:
            log.error("cannot load the plan", extra={"fields": {"plan": args.plan, "error": str(e)}})
            server.stop(0)
            return 2
    else:
        log.info("no plan yet: NOT_SERVING until LoadPlan")

    while not stop.wait(0.5):
        pass
    drain_started = time.monotonic()
    clean = daemon.drain(args.drain_timeout)
    # The engine is done (or aborted what was left); Generate streams still being read get the
    # rest of the drain time. Not server.stop(grace): it would wait as long for health Watch and
    # reflection streams, which never end on their own.
    while server.helm_guard.generate.serving and time.monotonic() < drain_started + args.drain_timeout:
        time.sleep(0.1)
    server.stop(grace=2.0).wait(7.0)
    daemon.close()
    if metrics is not None:
        metrics.close()
    if daemon.device_lost is not None:
        log.error("stopped: a GPU was lost, restart the daemon", extra={"fields": {"error": daemon.device_lost}})
        return EXIT_DEVICE_LOST
    log.info("stopped", extra={"fields": {"drained": clean}})
    return 0
