"""rematd's service: one transport-neutral core behind gRPC and HTTP adapters.

Imports no torch: the service runs on machines without it.
"""

from rematd.server.app import Bound, Service, ServiceThread
from rematd.server.config import ServeConfig
from rematd.server.core.advisor import AdvisorCore, JobNotFound
from rematd.server.metrics.registry import Metrics
from rematd.server.store.store import Store

__all__ = ["AdvisorCore", "Bound", "JobNotFound", "Metrics", "ServeConfig", "Service", "ServiceThread", "Store"]
