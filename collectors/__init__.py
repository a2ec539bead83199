"""Typed observations of one host. Imports nothing of ours (the layering contract)."""

from collectors.identity import (
    NODE_IDENTITY_NAMESPACE,
    IdentityError,
    NodeIdentity,
    resolve_identity,
)
from collectors.nvml import NvidiaNvmlCollector
from collectors.system import SystemHostCollector

__all__ = [
    "NODE_IDENTITY_NAMESPACE",
    "IdentityError",
    "NodeIdentity",
    "NvidiaNvmlCollector",
    "SystemHostCollector",
    "resolve_identity",
]
