"""Dagster resources: the storage root, the torch device and an optional Ray cluster (thin wrappers)."""

import time
from typing import ClassVar
from urllib.parse import urlparse

from dagster import ConfigurableResource, DagsterInstance
from dagster_ray import RayResource

from qk_core.config.settings import Settings
from qk_core.io.storage import Storage

GPU_POOL = "gpu"  # the concurrency pool of every step that holds the device: capture, intervention and extension probes


def initialise_pools(instance: DagsterInstance) -> bool:
    """Give the ``gpu`` pool its default limit (``concurrency.pools.default_limit``) if it has none yet; True
    when it did. Dagster does so on the run queue's first tick that sees the pool, but after that tick has read
    the configured pools, so every run of a new pool queued by then starts at once (a fresh instance's first
    backfill ran three captures side by side). A limit set by hand (``dagster instance concurrency set``) stays."""
    storage = instance.event_log_storage
    if GPU_POOL in storage.get_concurrency_keys():
        return False
    return bool(storage.initialize_concurrency_limit_to_default(GPU_POOL))


class StorageResource(ConfigurableResource):
    """The one storage root (local path or s3://bucket/prefix). Credentials come from the env only."""

    root: str
    s3_endpoint_url: str | None = None

    def get(self) -> Storage:
        return Storage(self.root, self.s3_endpoint_url)

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "StorageResource":
        settings = settings or Settings.from_env()
        return cls(root=settings.storage_root, s3_endpoint_url=settings.s3_endpoint_url)


class TorchDeviceResource(ConfigurableResource):
    """Where capture runs: ``auto`` picks CUDA when present, else CPU."""

    device: str = "auto"

    def resolve(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # imported lazily: definitions load without torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class RayClusterResource(RayResource):
    """An existing Ray cluster that captures are sharded onto (``QK_RAY_ADDRESS``; issue 12).

    dagster-ray's resource interface for a cluster this platform neither creates nor deletes: with an
    ``address`` (Ray Client, ``ray://host:10001``, e.g. a KubeRay head service) the step connects with
    ``ray.init`` for its duration and :func:`qk_core.capture.sharded.capture_sharded` submits one GPU task
    per shard; without one nothing connects and the capture runs in the step process as before. The
    cluster is never deleted: the step only disconnects (and says so), and an unreachable address is a
    ``ConnectionError`` naming it.
    """

    address: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    @property
    def host(self) -> str:
        return urlparse(self.address).hostname or ""

    @property
    def ray_address(self) -> str:  # type: ignore[override]
        return self.address

    @property
    def name(self) -> str:
        return f"Ray cluster {self.address}" if self.enabled else "no Ray cluster"

    @property
    def created(self) -> bool:  # an existing cluster: never created or deleted here
        return True

    @property
    def ready(self) -> bool:
        return True

    CONNECT_ATTEMPTS: ClassVar[int] = 3

    def connect(self, context):  # type: ignore[no-untyped-def]
        """dagster-ray's connect, tried afresh up to CONNECT_ATTEMPTS times: when the head's Ray Client server
        fails to start the session's server process, the failed ``ray.init`` leaves the client half
        initialised (a retry inside it then fails on an assertion), so each new attempt starts from
        ``ray.shutdown()``."""
        if not self.enabled:
            return None
        import ray

        t0 = time.monotonic()
        for attempt in range(1, self.CONNECT_ATTEMPTS + 1):
            try:
                return super().connect(context)
            except (ConnectionError, AssertionError) as exc:
                ray.shutdown()
                if attempt == self.CONNECT_ATTEMPTS:
                    port = urlparse(self.address).port or 10001
                    raise ConnectionError(
                        f"{self.name} (QK_RAY_ADDRESS): no Ray Client connection after {attempt} attempts over "
                        f"{time.monotonic() - t0:.0f} s ({type(exc).__name__}: {exc}); check that the head runs "
                        f"`ray start --head --ray-client-server-port={port}` and that {self.host}:{port} is "
                        f"reachable from this host") from exc
                context.log.warning(f"{self.name}: connection attempt {attempt} failed ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}); trying again")
                time.sleep(2.0 * attempt)
        return None

    def on_connect(self, context):  # type: ignore[no-untyped-def]
        if self.enabled:  # without a cluster nothing connected: say nothing
            super().on_connect(context)

    def on_cleanup(self, context, *, deleted: bool):  # type: ignore[no-untyped-def]
        """Replaces dagster-ray's 'Deleted <cluster> according to cleanup policy' line: nothing is deleted
        here (``delete`` is a no-op for an existing cluster), the step only disconnected."""
        if self.enabled and self.connected:  # a failed connect has nothing to disconnect
            context.log.info(f"Disconnected from {self.name}; the cluster keeps running (not created or "
                             f"deleted by this platform)")

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "RayClusterResource":
        settings = settings or Settings.from_env()
        return cls(address=settings.ray_address)
