"""The service's transports, thin adapters over the core: the gRPC servicer and the HTTP app
(REST, dashboard, /metrics)."""
