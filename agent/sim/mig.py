"""Simulated MIG: which GPUs of a node are split into which GPU instances, and the handles NVML gives them.

A MIG profile is named `<compute slices>g.<memory>gb` after the board's memory (an H100 80GB's 1g.10gb, an
A100 40GB's 1g.5gb). A board has 7 compute slices and 8 memory slices; the layouts a scenario may ask for
are checked against both. GPU instance ids follow the placements NVML gives on Ampere and Hopper (7g: 0,
4g: 1, 3g: 1-2, 2g: 3-5, 1g: 7-13, the first free one); each GPU instance holds one compute instance, id 0.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

from gpufleet.agent.sim.hardware import GpuModel

COMPUTE_SLICES = 7
MEMORY_SLICES = 8
MAX_MIG_DEVICES = 7
# Models whose simulated boards can be put in MIG mode.
MIG_CAPABLE = frozenset({"h100-sxm", "a100-sxm4"})
# Compute slices -> memory slices of the standard profiles (1g.20gb: the double-memory 1g of Hopper).
_MEMORY_SLICES: Mapping[str, int] = {"1g": 1, "1g+": 2, "2g": 2, "3g": 4, "4g": 4, "7g": 8}
_GI_IDS: Mapping[int, tuple[int, ...]] = {7: (0,), 4: (1,), 3: (1, 2), 2: (3, 4, 5), 1: (7, 8, 9, 10, 11, 12, 13)}
# Each instance's activity as a share of the whole GPU's, so instances differ in a deterministic way.
_ACTIVITY_SHARES = (1.0, 0.85, 0.7, 0.9, 0.6, 0.95, 0.75)


class MigLayoutError(ValueError):
    """A MIG layout the board cannot hold; the message names the profile or the slice count."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile on one board."""

    name: str
    compute_slices: int
    memory_slices: int


def profiles(model: GpuModel) -> dict[str, MigProfile]:
    """The profiles `model` offers, by name."""
    gib = model.memory_total_bytes / 1024**3
    unit = round(gib / MEMORY_SLICES / 5) * 5 or 5  # 80 GB boards: 10 GB a slice; 40 GB boards: 5
    out: dict[str, MigProfile] = {}
    for key, memory in _MEMORY_SLICES.items():
        compute = int(key[0])
        name = f"{compute}g.{unit * memory}gb"
        out.setdefault(name, MigProfile(name, compute, memory))
    return out


def check_layout(model: GpuModel, names: tuple[str, ...]) -> tuple[MigProfile, ...]:
    """The profiles of a layout, in order; MigLayoutError where the board cannot hold it."""
    if model.key not in MIG_CAPABLE:
        raise MigLayoutError(f"{model.name} has no MIG mode (MIG boards: {', '.join(sorted(MIG_CAPABLE))})")
    known = profiles(model)
    out = []
    for name in names:
        if name not in known:
            raise MigLayoutError(f"unknown MIG profile {name!r} on {model.name} (known: {', '.join(known)})")
        out.append(known[name])
    if sum(p.compute_slices for p in out) > COMPUTE_SLICES:
        raise MigLayoutError(f"{', '.join(names)} needs more than the board's {COMPUTE_SLICES} compute slices")
    if sum(p.memory_slices for p in out) > MEMORY_SLICES:
        raise MigLayoutError(f"{', '.join(names)} needs more than the board's {MEMORY_SLICES} memory slices")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SimInstance:
    """One GPU instance (with its one compute instance) as the simulator answers for it."""

    gpu: int
    position: int  # MIG device index under the parent
    profile: MigProfile
    gpu_instance_id: int
    uuid: str
    memory_total_bytes: int
    activity_share: float
    compute_instance_id: int = 0

    def memory_used_bytes(self, parent_used: int, parent_slices: int) -> int:
        """This instance's share of what the parent's job holds, by memory slices."""
        return min(self.memory_total_bytes, parent_used * self.profile.memory_slices // max(parent_slices, 1))


def instances(node: str, model: GpuModel, gpu: int, layout: tuple[MigProfile, ...]) -> tuple[SimInstance, ...]:
    """The GPU instances of one GPU's layout, with their ids, UUIDs and memory."""
    usable = model.memory_total_bytes - model.memory_reserved_bytes
    taken: set[int] = set()
    out = []
    for position, profile in enumerate(layout):
        gi = next(i for i in _GI_IDS[profile.compute_slices] if i not in taken)
        taken.add(gi)
        h = hashlib.blake2b(f"{node}/{gpu}/mig/{gi}".encode(), digest_size=16).hexdigest()
        uuid = f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
        memory = usable * profile.memory_slices // MEMORY_SLICES
        share = _ACTIVITY_SHARES[position % len(_ACTIVITY_SHARES)]
        out.append(SimInstance(gpu, position, profile, gi, uuid, memory, share))
    return tuple(out)
