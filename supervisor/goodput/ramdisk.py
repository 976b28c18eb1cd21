"""Ramdisk size per host for the in-memory checkpoint tier, by GKE's rule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from supervisor.goodput.checkpoint_intervals import check_positive

#: GKE's guide: "Total Checkpoint Size ≈ Number of Parameters x 12 bytes" (weights + optimizer).
BYTES_PER_PARAMETER = 12


def _exact(value: float) -> Fraction:
    return Fraction(value) if isinstance(value, int) else Fraction(repr(value))


@dataclass(frozen=True)
class RamdiskSizing:
    """Ramdisk per host, with the intermediate figures of GKE's calculation."""

    parameters: float
    hosts: int
    buffer: float
    bytes_per_parameter: float
    #: parameters x bytes_per_parameter.
    checkpoint_bytes: int
    #: checkpoint_bytes / hosts.
    shard_bytes: int
    #: 2 x shard_bytes (two checkpoints held while the next one is written).
    double_buffered_bytes: int
    #: double_buffered_bytes x (1 + buffer), rounded up.
    size_bytes: int

    @property
    def size_mib(self) -> int:
        """Size in MiB, rounded up: the unit of xpk's ``--mtc-ramdisk-size`` (e.g. 60000Mi)."""
        return -(-self.size_bytes // 2**20)


def ramdisk_sizing(
    parameters: float,
    hosts: int,
    buffer: float = 0.15,
    *,
    bytes_per_parameter: float = BYTES_PER_PARAMETER,
) -> RamdiskSizing:
    """Ramdisk size per host for the in-memory checkpoint tier, as GKE computes it.

    GKE's guide ("Calculating Ramdisk Size Per Host"): total checkpoint size ≈ parameters x
    12 bytes (model and optimizer state); it is sharded across the hosts; "Required
    Ramdisk Size per Pod ≈ 2 * (Total Checkpoint Size / Number of Hosts in the Slice)";
    "add a 10-15% buffer", applied as a factor: its example, 70e9 parameters on 32 hosts,
    gives 840 GB, 26.25 GB per host, 52.5 GB doubled, x 1.15 ≈ 60.3 GB. Sizes are exact
    (rational arithmetic) and rounded up to a whole byte only at the end.
    """
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
    check_positive("parameters", parameters)
    check_positive("bytes_per_parameter", bytes_per_parameter)
    check_positive("buffer", buffer, allow_zero=True)
    total = _exact(parameters) * _exact(bytes_per_parameter)
    shard = total / hosts
    doubled = 2 * shard
    size = doubled * (1 + _exact(buffer))
    return RamdiskSizing(
        parameters=parameters,
        hosts=hosts,
        buffer=buffer,
        bytes_per_parameter=bytes_per_parameter,
        checkpoint_bytes=math.ceil(total),
        shard_bytes=math.ceil(shard),
        double_buffered_bytes=math.ceil(doubled),
        size_bytes=math.ceil(size),
    )


def ramdisk_size_bytes(
    parameters: float,
    hosts: int,
    buffer: float = 0.15,
    *,
    bytes_per_parameter: float = BYTES_PER_PARAMETER,
) -> int:
    """Bytes of ramdisk per host: ``2 x parameters x 12 / hosts x (1 + buffer)``, rounded up.

    See :func:`ramdisk_sizing` for the rule (GKE's) and the intermediate figures.
    """
    return ramdisk_sizing(
        parameters, hosts, buffer, bytes_per_parameter=bytes_per_parameter
    ).size_bytes
