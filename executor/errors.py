"""Error types of the executor.

Every failure a user can cause (a bad checkpoint, a bad plan, a bad request) raises a subclass
of `HelmError` with a message that names the problem; the CLI and the daemon turn these into
clear messages and status codes instead of tracebacks.
"""


class HelmError(Exception):
    """Base class: an error the user can act on."""


class ConfigError(HelmError):
    """config.json is missing, unreadable, or describes a model HELM cannot run."""


class WeightsError(HelmError):
    """A weight file is missing, corrupt, or a tensor is absent or mis-shaped."""


class RequestError(HelmError, ValueError):
    """A generation request is invalid (empty prompt, bad sampling value, too long...)."""


class PlacementError(HelmError):
    """A split or stage layout is inconsistent with the model."""


class PlanNotFoundError(PlacementError):
    """A plan path that does not exist."""


class PlanLoadError(PlacementError):
    """A valid plan that cannot serve here: its weights or warm-up failed (memory, device)."""


class LoadInProgressError(HelmError):
    """Another plan is being loaded; the daemon loads one at a time."""


class NotReadyError(HelmError):
    """The daemon has no plan loaded yet."""


class OverloadedError(HelmError):
    """The daemon's request queue is full."""


class ShuttingDownError(HelmError):
    """The daemon is draining before it exits."""


class RequestFailedError(HelmError):
    """A request failed while it ran; the other requests carry on."""


class DeviceLostError(HelmError):
    """A GPU this process runs on can run nothing more (a sticky CUDA error: an illegal address,
    a device-side assert): only a new process can use it again."""


class CredentialError(HelmError, ValueError):
    """A token file, certificate or key that is missing, unreadable or malformed."""
