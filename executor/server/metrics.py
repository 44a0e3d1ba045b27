"""Prometheus metrics of the daemon (`serve --metrics-port`), what an operator scrapes:

    helm_requests_total{outcome,code}                 Generate calls by how they ended
    helm_ttft_seconds, helm_decode_tokens_per_second  per finished request (histograms)
    helm_prompt_tokens_total{kv}                      finished requests' prompt tokens: computed / reused
    helm_stage_step_seconds{stage,device,phase}       measured time of each stage per engine step
    helm_stage_predicted_step_seconds{...}            the plan's prediction for the same steps
    helm_queue_requests{state}                        waiting / running / in flight (all plans)
    helm_kv_pages{stage,pool,state}                   KV pages used / free per pool
    helm_plan_info{digest,version,split_k}, helm_serving_state{state}

Counters and histograms are updated as things happen; queue and KV gauges are read from the
daemon when scraped. Each daemon has its own registry (no process-global state).
"""
from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("helm.metrics")

# Step times span a 1-token decode of a small stage (~0.1 ms) to a long prompt chunk (seconds).
STEP_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RATE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
STATES = ("loading", "serving", "draining")
MAX_SCRAPES = 8  # connections served at once; one beyond is closed at once
SCRAPE_DEADLINE_S = 10.0  # a connection's whole life: its request in, the answer out


class DaemonMetrics:
    def __init__(self, daemon):
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("helm_requests", "Generate calls by outcome (finish reason, or why not) and status",
                                ("outcome", "code"), registry=self.registry)
        self.ttft = Histogram("helm_ttft_seconds", "Time from accepting a request to its first token",
                              buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter("helm_prompt_tokens", "Prompt tokens of finished requests, by whether their "
                                     "K/V were computed or reused from a kept prefix", ("kv",), registry=self.registry)
        self.decode_rate = Histogram("helm_decode_tokens_per_second", "Decode rate of a finished request "
                                     "(tokens after the first)", buckets=RATE_BUCKETS, registry=self.registry)
        labels = ("stage", "device", "phase")
        self.step = Histogram("helm_stage_step_seconds", "Measured time of a stage per engine step", labels,
                              buckets=STEP_BUCKETS_S, registry=self.registry)
        self.predicted = Histogram("helm_stage_predicted_step_seconds", "The plan's predicted time of a stage "
                                   "for the same steps", labels, buckets=STEP_BUCKETS_S, registry=self.registry)
        self.registry.register(_DaemonState(daemon))
        daemon.on_step = self.observe_step

    def observe_step(self, phase: str, devices: tuple[str, ...], stage_ms: tuple[tuple[float, float], ...]) -> None:
        """One engine step (the worker's thread): measured and predicted ms per stage."""
        for i, ((measured, predicted), device) in enumerate(zip(stage_ms, devices)):
            self.step.labels(str(i), device, phase).observe(measured / 1e3)
            self.predicted.labels(str(i), device, phase).observe(predicted / 1e3)

    def request_finished(self, finish_reason: str, ttft_s: float, decode_tokens_per_s: float,
                         completion_tokens: int, prompt_tokens: int = 0, cached_prompt_tokens: int = 0) -> None:
        self.requests.labels(finish_reason, "OK").inc()
        self.prompt_tokens.labels("computed").inc(prompt_tokens - cached_prompt_tokens)
        self.prompt_tokens.labels("reused").inc(cached_prompt_tokens)
        if completion_tokens:
            self.ttft.observe(ttft_s)
        if completion_tokens > 1:
            self.decode_rate.observe(decode_tokens_per_s)

    def request_ended(self, outcome: str, code: str) -> None:
        """A request refused, failed, cancelled or cut off (code: the gRPC status name)."""
        self.requests.labels(outcome, code).inc()

    def serve_http(self, host: str, port: int) -> int:
        """Start the /metrics endpoint (plain HTTP: the serve command keeps it on loopback unless
        told --insecure; prometheus_client's TLS does its handshakes on the accepting thread, where
        one idle connection blocks every scrape); the port it listens on."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv4 or IPv6, as host is
        server_class = type("ScrapeServer", (_ScrapeServer,), {"address_family": family})
        server = make_server(host, port, make_wsgi_app(self.registry), server_class, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._http = server
        return server.server_port

    def close(self) -> None:
        if getattr(self, "_http", None) is not None:
            self._http.shutdown()
            self._http.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 — the base class's name
        """Scrapes are not logged: they come every few seconds."""


class _ScrapeServer(ThreadingMixIn, WSGIServer):
    """The /metrics HTTP server, bounded: a thread per connection (prometheus_client's server), but
    at most MAX_SCRAPES of them, and each connection closed SCRAPE_DEADLINE_S after it was
    accepted, whether its request came or not; so connections opened and left half-sent (or a
    request sent a byte at a time) cannot pile up threads."""
    daemon_threads = True

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts process_request_thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        request.settimeout(SCRAPE_DEADLINE_S)
        deadline = threading.Timer(SCRAPE_DEADLINE_S, _close_socket, (request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()

    def handle_error(self, request, client_address):
        log.debug("metrics connection ended early", extra={"fields": {"client": str(client_address)}})


def _close_socket(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _DaemonState:
    """Gauges read from the daemon at scrape time."""

    def __init__(self, daemon):
        self.daemon = daemon

    def describe(self):
        return []  # computed at scrape time: nothing to check at registration

    def collect(self):
        info = self.daemon.info()
        queue = GaugeMetricFamily("helm_queue_requests", "Requests in the daemon", labels=("state",))
        queue.add_metric(("waiting",), info.waiting)
        queue.add_metric(("running",), info.running)
        queue.add_metric(("on_previous_plans",), info.on_previous_plans)
        queue.add_metric(("in_flight",), self.daemon.in_flight)
        yield queue
        limits = GaugeMetricFamily("helm_queue_limit", "Admission limits", labels=("limit",))
        limits.add_metric(("max_batch",), info.max_batch)
        limits.add_metric(("max_queue",), info.max_queue)
        yield limits
        pages = GaugeMetricFamily("helm_kv_pages", "KV cache pages per stage and pool",
                                  labels=("stage", "pool", "state"))
        for s in info.stages:
            if s.kv is None:
                continue
            pages.add_metric((str(s.index), "device", "used"), s.kv.device_pages_used)
            if s.kv.device_pages_capacity is not None:
                pages.add_metric((str(s.index), "device", "free"),
                                 max(0, s.kv.device_pages_capacity - s.kv.device_pages_used))
            pages.add_metric((str(s.index), "host", "used"), s.kv.host_pages_used)
        yield pages
        state = GaugeMetricFamily("helm_serving_state", "1 for the daemon's state", labels=("state",))
        for name in STATES:
            state.add_metric((name,), 1.0 if info.state == name else 0.0)
        yield state
        if info.plan is not None:
            plan = GaugeMetricFamily("helm_plan_info", "The plan serving", labels=("digest", "version", "split_k"))
            plan.add_metric((info.plan.digest, str(info.plan.version), str(info.plan.split_k)), 1.0)
            yield plan
