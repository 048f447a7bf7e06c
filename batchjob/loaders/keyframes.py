"""Where a clip's keyframes are: from the container's sample table when it is provably complete, else
from one demux sweep over every packet (no decoding either way).

The sample table of an MP4/MOV lists every sample with its keyframe flag before a single packet is
read, so listing keyframes costs one binary search per keyframe instead of reading the whole file. Its
timestamps are decode timestamps (DTS), which is why the table path keeps decode positions and leaves the
presentation index to be settled when the keyframe itself is read (see `decode.read_keyframe`).
Matroska/WebM load their cues lazily and other containers may index only part of a stream, so they take
the sweep, which sees presentation timestamps directly.

Edit lists: an MP4 cut without re-encoding (`ffmpeg -ss T -c copy`) starts at the keyframe before T and
hides the pictures before T with an edit list (the demuxer flags their packets "discard"; decoders drop
them). Hidden pictures are not frames of the clip: they are neither counted nor picked. The visible frames
before the first visible keyframe are reached from the hidden keyframe; the first of them stands in for
that keyframe (`Keyframe.shown_pts`). Such files take the sweep, which sees the flags per packet.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from typing import Literal

import av

from batchjob.loaders.errors import CorruptVideo, MissingTimestamps
from batchjob.loaders.media import is_mp4_family
from batchjob.loaders.registry import LoaderOption

USE_INDEX_OPTION = LoaderOption(bool, "false: list keyframes by a demux sweep, never from the MP4 sample table")

# A sweep reads each packet once; a file has finitely many, but a broken demuxer must not spin forever.
MAX_PACKETS = 50_000_000


@dataclasses.dataclass(frozen=True)
class Keyframe:
    """One keyframe: where to seek, how to recognise its packet, and (sweep only) its frame index."""

    decode_position: int  # samples before it in decode order
    seek_ts: int  # timestamp to hand av_seek_frame in stream time base (DTS for MP4, PTS elsewhere)
    dts: int | None
    pts: int | None  # known from the sweep; the sample table does not carry it
    pos: int  # byte offset of its packet, -1 if unknown
    index: int | None  # presentation index; None until the keyframe is read (table path)
    shown_pts: int | None = None  # set when an edit list hides this keyframe: the first visible frame's PTS
    # MP4 only: just before the next keyframe's DTS. FFmpeg's MP4 seek reads the target as a presentation time and
    # moves it back onto the DTS axis by the stream's B-frame delay, so seeking to a keyframe's own DTS lands on
    # the keyframe before it, and reaching this one means demuxing (and, remotely, fetching) a whole GOP. A target
    # inside the following GOP lands here whenever that delay is shorter than a GOP (see decode._seek).
    seek_ts_late: int | None = None


@dataclasses.dataclass(frozen=True)
class KeyframeListing:
    total_num_frames: int
    keyframes: list[Keyframe]
    source: Literal["index", "sweep"]
    sorted_pts: list[int] | None = None  # every frame's PTS in presentation order (sweep only)
    decode_pts: list[int] | None = None  # every frame's PTS in decode order (sweep only); Keyframe.decode_position
                                         # indexes it


def _keyframe_positions(entries, count: int) -> list[int] | None:
    """Decode positions of every keyframe, found by stepping back from the end with FFmpeg's own
    binary search (`av_index_search_timestamp`): about one search per keyframe instead of building a
    Python object for each of the tens of thousands of samples. None if the table misbehaves."""
    positions = []
    position = entries.search_timestamp(entries[count - 1].timestamp, backward=True)
    while position >= 0:
        positions.append(position)
        if position == 0 or len(positions) > count:
            break
        earlier = entries.search_timestamp(entries[position].timestamp - 1, backward=True)
        if earlier >= position:  # timestamps not strictly increasing: do not trust this table
            return None
        position = earlier
    positions.reverse()
    return positions


def from_sample_table(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                      label: str) -> KeyframeListing | None:
    """The MP4/MOV sample table, or None when it cannot be shown to list every frame.

    Complete means: an MP4-family container and as many entries as the header's frame count (a
    fragmented MP4 indexes only the fragments read so far, and fails the count), with keyframes. A table
    whose keyframes or last sample lie past the end of the file proves the file was cut short (an MP4
    with its index up front keeps the index when truncated): that is an error, not a reason to fall back.
    """
    if not is_mp4_family(container) or stream.frames <= 0:
        return None
    entries = stream.index_entries
    count = len(entries)
    if count != stream.frames:
        return None
    if entries[0].is_discard or entries[count - 1].is_discard:  # an edit list hides frames: sweep
        return None
    positions = _keyframe_positions(entries, count)
    if not positions:
        return None
    # Entries are views into FFmpeg's memory: copy the fields out while the container is open.
    rows = [(p, entries[p]) for p in positions]
    last = entries[count - 1]
    late = [e.timestamp - 1 for _, e in rows[1:]] + [last.timestamp]
    keyframes = [Keyframe(p, e.timestamp, e.timestamp, None, e.pos, None, seek_ts_late=t)
                 for (p, e), t in zip(rows, late)]
    data_end = max([last.pos + last.size] + [e.pos + e.size for _, e in rows])
    if 0 < container.size < data_end:
        raise CorruptVideo(label, f"truncated: its index places frames up to byte {data_end} but the file "
                                  f"holds {container.size} bytes; re-download or re-encode it")
    return KeyframeListing(count, keyframes, "index")


def _declared_seconds(container, stream) -> float | None:
    """How long the header says the video lasts: stream duration, Matroska's DURATION tag, or (for a
    file holding only this stream) the container's duration. None when nothing is declared."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    if tag:
        try:
            hours, minutes, seconds = tag.split(":")
            return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        except ValueError:
            return None
    if container.duration and len(container.streams) == 1:
        return container.duration / 1_000_000
    return None


def _check_not_cut_short(container, stream, sorted_pts: list[int], label: str) -> None:
    """Matroska/WebM cut short still demux cleanly up to the cut; only the header's duration shows it."""
    declared = _declared_seconds(container, stream)
    if declared is None or not stream.time_base:
        return
    count = len(sorted_pts)
    span = float((sorted_pts[-1] - sorted_pts[0]) * stream.time_base)
    frame = span / max(1, count - 1)
    seen = span + frame  # the last frame lasts one interval too
    if seen < declared - (2 * frame + 0.1):
        raise CorruptVideo(label, f"truncated: packets cover {seen:.2f} s of the {declared:.2f} s its header "
                                  "declares; re-download or re-encode it")


def from_sweep(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
               label: str) -> KeyframeListing:
    """Demux every packet of the stream once, keeping timestamps and keyframe flags (the reference way).

    The loop touches as few packet attributes as it can: on a 600 s clip it runs 18,000 times.
    """
    mp4 = is_mp4_family(container)
    all_pts: list[int] = []  # decode order, visible frames only
    keys = []  # (decode position, pts, dts, pos)
    hidden_key = None  # the last keyframe an edit list hides, before any visible keyframe
    for count, packet in enumerate(container.demux(stream)):
        if count >= MAX_PACKETS:
            break
        if packet.size == 0:  # the empty packet PyAV yields at the end
            continue
        pts = packet.pts
        if pts is None:
            raise MissingTimestamps(label, f"packet {len(all_pts)} has no presentation timestamp; remux it "
                                           "into MP4 or MKV (ffmpeg -i IN -c copy OUT.mp4)")
        if packet.is_corrupt:
            raise CorruptVideo(label, f"packet {len(all_pts)} is flagged corrupt by the demuxer (damaged or "
                                      "cut-off data); re-download or re-encode it")
        if packet.is_discard:
            if packet.is_keyframe and not keys:
                hidden_key = (len(all_pts), pts, packet.dts, packet.pos if packet.pos is not None else -1)
            continue
        if packet.is_keyframe:
            keys.append((len(all_pts), pts, packet.dts, packet.pos if packet.pos is not None else -1))
        all_pts.append(pts)
    if not all_pts:
        return KeyframeListing(0, [], "sweep", [], [])
    sorted_pts = sorted(all_pts)
    _check_not_cut_short(container, stream, sorted_pts, label)
    keyframes = [Keyframe(position, dts if (mp4 and dts is not None) else pts, dts, pts, pos,
                          bisect_left(sorted_pts, pts)) for position, pts, dts, pos in keys]
    if hidden_key is not None and (not keyframes or keyframes[0].index > 0):
        position, pts, dts, pos = hidden_key
        keyframes.insert(0, Keyframe(position, dts if (mp4 and dts is not None) else pts, dts, pts, pos, 0,
                                     shown_pts=sorted_pts[0]))
    return KeyframeListing(len(all_pts), keyframes, "sweep", sorted_pts, all_pts)


def list_keyframes(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
                   label: str, *, allow_index: bool = True) -> KeyframeListing:
    """Sample table first (fast), sweep otherwise; `allow_index=False` forces the sweep (tests, bench)."""
    listing = from_sample_table(container, stream, label) if allow_index else None
    return listing if listing is not None else from_sweep(container, stream, label)
