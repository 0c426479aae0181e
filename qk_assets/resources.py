"""Dagster resources: the storage root and the torch device (thin wrappers over qk_core)."""

from dagster import ConfigurableResource

from qk_core.settings import Settings
from qk_core.storage import Storage


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
