"""Readers of what the loggers wrote, from the files themselves (no logger code involved):
wandb's .wandb run file and TensorBoard's event files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Iterator


def wandb_records(path: Path) -> Iterator:
    """The protobuf Records of a .wandb file: a LevelDB-style log (a 7-byte ':W&B' header, then
    32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1) | data`, a record split
    over FIRST/MIDDLE/LAST chunks; block tails shorter than a chunk header are padding)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    i, buf = 7, b""
    while i + 7 <= len(data):
        if block - i % block < 7:
            i += block - i % block
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + 7])
        buf += data[i + 7:i + 7 + length]
        i += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def tensorboard_events(run_dir: Path) -> Iterator[Any]:
    """Every Event of a run's event files, files in name order as TensorBoard reads them: TFRecords
    (`length (8) | crc (4) | Event protobuf | crc (4)`), parsed with the Event message tensorboardX ships."""
    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = Event()
            event.ParseFromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4
            yield event


def tensorboard_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {tag: value} of every scalar in a run's event files."""
    out: dict[int, dict[str, float]] = {}
    for event in tensorboard_events(run_dir):
        for value in event.summary.value:
            if value.WhichOneof("value") == "simple_value":
                out.setdefault(event.step, {})[value.tag] = value.simple_value
    return out
