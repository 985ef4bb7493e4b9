"""Speculation mode names: the proto enum's, without their prefix, lower-cased.

SPECULATION_MODE_SSD is "ssd": the names the CLI, the config, the bench and the coordinator's
spans and stats use. The enum is the only list of modes; nothing here repeats it.
"""

from __future__ import annotations

from specd.v1.coordinator_pb2 import SpeculationMode

_PREFIX = "SPECULATION_MODE_"


def mode_name(value: int) -> str:
    """The name of a SpeculationMode value; ValueError for a value the enum lacks."""
    return SpeculationMode.Name(value).removeprefix(_PREFIX).lower()


def mode_value(name: str) -> int:
    """The SpeculationMode value of a name; ValueError for a name the enum lacks."""
    return SpeculationMode.Value(_PREFIX + name.upper())


MODES = tuple(mode_name(value) for value in SpeculationMode.values())  # auto, ssd, sd, off
AUTO = mode_name(SpeculationMode.SPECULATION_MODE_AUTO)  # ssd when a draft worker is reachable, else off
SSD = mode_name(SpeculationMode.SPECULATION_MODE_SSD)
SD = mode_name(SpeculationMode.SPECULATION_MODE_SD)
OFF = mode_name(SpeculationMode.SPECULATION_MODE_OFF)
