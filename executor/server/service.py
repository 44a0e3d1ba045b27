"""The gRPC servicer of helm.executor.v1.ExecutorService.

It only converts: protobuf in → domain objects → `Daemon` → domain objects → protobuf out, and
maps the daemon's errors to status codes (`status_for`). Any other exception becomes INTERNAL
with its message, so a request never crashes the daemon or leaves a stream hanging.
"""
from __future__ import annotations

import functools
import logging

import grpc

from executor.errors import (ConfigError, HelmError, NotReadyError, OverloadedError, PlacementError,
                             PlanNotFoundError, RequestError, RequestFailedError, ShuttingDownError, WeightsError)
from executor.pb import executor_pb2 as pb
from executor.pb import executor_pb2_grpc as pb_grpc
from executor.server.daemon import Daemon
from executor.server.messages import GenerateSpec, PlanSource

log = logging.getLogger("helm.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name

_STATUS = (  # the first matching class wins: subclasses before their bases
    (PlanNotFoundError, grpc.StatusCode.NOT_FOUND),
    (NotReadyError, grpc.StatusCode.FAILED_PRECONDITION),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (RequestFailedError, grpc.StatusCode.INTERNAL),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (PlacementError, grpc.StatusCode.INVALID_ARGUMENT),   # a bad plan (the message names the field)
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),   # the daemon's checkpoint is broken
    (WeightsError, grpc.StatusCode.FAILED_PRECONDITION),
    (HelmError, grpc.StatusCode.INVALID_ARGUMENT),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    return next((code for cls, code in _STATUS if isinstance(error, cls)), grpc.StatusCode.INTERNAL)


def _abort(context, method: str, error: Exception):
    code = status_for(error)
    message = str(error) if isinstance(error, (HelmError, MemoryError)) else f"{type(error).__name__}: {error}"
    fields = {"rpc": method, "code": code.name, "message": message}
    if code == grpc.StatusCode.INTERNAL:
        log.error("rpc failed", extra={"fields": fields}, exc_info=not isinstance(error, HelmError))
    else:
        log.info("rpc refused", extra={"fields": fields})
    context.abort(code, message)


def _unary(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:  # noqa: BLE001 — every failure becomes a status
            _abort(context, method.__name__, e)
    return wrapper


def _streaming(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as e:  # noqa: BLE001
            _abort(context, method.__name__, e)
    return wrapper


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    @_streaming
    def Generate(self, request, context):
        handle = self.daemon.submit(GenerateSpec.from_pb(request))
        if not context.add_callback(handle.cancel):  # already over: the client left before we started
            handle.cancel()
        for event in handle:
            yield event.to_pb(pb, handle.request_id)

    @_unary
    def LoadPlan(self, request, context):
        return self.daemon.load_plan(PlanSource.from_pb(request)).to_pb(pb)

    @_unary
    def GetPlan(self, request, context):
        summary, text = self.daemon.plan()
        return pb.GetPlanResponse(plan=summary.to_pb(pb), yaml=text)

    @_unary
    def Info(self, request, context):
        return self.daemon.info().to_pb(pb)

    @_unary
    def GetReport(self, request, context):
        return self.daemon.report(request.plan_digest).to_pb(pb)
