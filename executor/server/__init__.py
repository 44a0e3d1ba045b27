"""The executor daemon (`helm-executor serve`), in layers:

    serve (process: gRPC server, health, reflection, logs, signals)
      → service (servicer: protobuf ↔ domain objects, errors → status codes)
        → daemon (plans, admission, request streams, drain; no gRPC)
          → worker (one Engine on its own thread per loaded plan)
            → engine (continuous batching) → stages

`guard` is what every RPC passes first (roles, decodable requests, the Generate lane), `auth`
the credentials of both sides, `metrics` the Prometheus endpoint. `messages` holds the domain
types with their protobuf forms, `text` detokenization and stop strings, `client` a small client. The protobuf modules (`executor.pb`) are generated from
protos/ at install time.
"""
