"""Reading pictures after a seek: one keyframe alone, or a forward run from a keyframe to exact frames.

A keyframe is decoded by sending its packet alone and draining the decoder. Decoders with B-frame
reordering hold a picture back until later packets arrive; feeding them those packets would decode
delta frames, so draining is what keeps "keyframes only" literally true.
"""

from __future__ import annotations

import itertools

import av
import numpy as np

from batchjob.loaders.errors import CorruptVideo
from batchjob.loaders.keyframes import Keyframe
from batchjob.loaders.media import to_upright_rgb

# After a seek the demuxer may land a few packets early (Matroska seeks by cue points). Reaching the
# wanted packet from there is a demux-only walk, bounded so a lying index cannot make it endless.
MAX_WALK_PACKETS = 100_000
# Pictures that follow a keyframe in decode order but are shown before it (open-GOP "leading" pictures)
# sit within the decoder's reorder window; 64 is far above any codec's limit (HEVC allows 16).
MAX_REORDER = 64


def _seek(container, stream, kf: Keyframe, label: str):
    """Position the demuxer so the next packet is `kf`'s; returns (packet, packet iterator).

    With a late target (`Keyframe.seek_ts_late`) first: it lands on `kf` itself, or earlier (a walk); should it
    overshoot (a stream whose delay exceeds a GOP), the keyframe's own timestamp is sought instead."""
    if kf.seek_ts_late is not None and kf.pos >= 0:
        container.seek(kf.seek_ts_late, stream=stream, backward=True, any_frame=False)
        stream.codec_context.flush_buffers()
        packets = container.demux(stream)
        first = next(packets, None)
        if first is not None and first.size and first.pos is not None and 0 <= first.pos <= kf.pos:
            return _walk(itertools.chain([first], packets), kf, label)
    container.seek(kf.seek_ts, stream=stream, backward=True, any_frame=False)
    stream.codec_context.flush_buffers()
    return _walk(container.demux(stream), kf, label)


def _walk(packets, kf: Keyframe, label: str):
    """Demux forward to `kf`'s packet (bounded): returns (packet, the iterator after it)."""
    packets = iter(packets)
    for _, packet in zip(range(MAX_WALK_PACKETS), packets):
        if packet.size == 0:
            break
        if kf.pos >= 0 and packet.pos is not None and packet.pos >= 0:
            if packet.pos == kf.pos:
                return packet, packets
            if packet.pos > kf.pos:
                break
        elif packet.dts == kf.dts and (kf.pts is None or packet.pts == kf.pts):
            return packet, packets
    raise CorruptVideo(label, f"seeking did not reach the keyframe at decode position {kf.decode_position} "
                              "(the file ends early or its index is wrong); re-encode or remux it")


def decode_alone(codec, packet) -> list:
    """Send one packet, then drain: the decoder hands back that picture without seeing any other packet."""
    frames = list(codec.decode(packet)) + list(codec.decode(None))
    codec.flush_buffers()
    return frames


def read_keyframe(container, stream, kf: Keyframe, label: str) -> tuple[np.ndarray, int, int]:
    """Decode keyframe `kf` alone; return (upright RGB, its PTS, its presentation index).

    When the listing came from the MP4 sample table the presentation index is not known yet: it is the
    keyframe's decode position plus the leading pictures that follow it in decode order but are shown
    before it. Every packet that could be one has a DTS below the keyframe's PTS (a picture cannot be
    shown before it is decoded), so a short demux-only walk finds them all. Pictures before a keyframe in
    decode order are shown before it (codecs require that of random-access points), so they all count.
    """
    if kf.shown_pts is not None:  # hidden by an edit list: the first visible frame stands in for it
        found, _ = decode_run(container, stream, kf, {kf.shown_pts}, label, MAX_WALK_PACKETS)
        return found[kf.shown_pts], kf.shown_pts, kf.index
    packet, packets = _seek(container, stream, kf, label)
    pts = packet.pts
    if pts is None:
        raise CorruptVideo(label, f"keyframe at decode position {kf.decode_position} has no timestamp")
    frames = decode_alone(stream.codec_context, packet)
    shown = [f for f in frames if f.pts == pts] or frames[:1]
    if not shown:
        raise CorruptVideo(label, f"keyframe at decode position {kf.decode_position} decoded to no picture; "
                                  "the stream is damaged")
    index = kf.index
    if index is None:
        leading = 0
        for _, later in zip(range(MAX_REORDER), packets):
            if later.size == 0 or later.dts is None or later.dts >= pts:
                break
            if later.pts is not None and later.pts < pts:
                leading += 1
        index = kf.decode_position + leading
    return to_upright_rgb(shown[0], label), pts, index


def decode_run(container, stream, kf: Keyframe, wanted_pts: set[int], label: str,
               max_frames: int) -> tuple[dict[int, np.ndarray], int]:
    """Decode forward from `kf` until every PTS in `wanted_pts` has been shown; (pictures, frames decoded).

    The run may cross into the next GOP: with open GOPs the pictures shown just before the next keyframe
    need it as a reference, and decoding straight through gives them exactly as a full decode does. The
    starting keyframe's own leading pictures reference the GOP before it, which this run never decoded:
    they come out concealed (and flagged corrupt), but are shown before the keyframe and so never wanted.
    A packet the decoder refuses (damaged) is skipped: only the pictures that are wanted must come out whole.
    Once every wanted picture's packet has been sent, the decoder is drained instead of fed: a picture only
    references pictures decoded before it, and the ones it holds back for reordering come out without
    decoding the packets that follow.
    """
    packet, packets = _seek(container, stream, kf, label)
    codec = stream.codec_context
    found: dict[int, np.ndarray] = {}
    decoded = 0
    last = max(wanted_pts)
    unsent = set(wanted_pts)

    def take(packet) -> bool:
        nonlocal decoded
        try:
            frames = codec.decode(packet)
        except av.error.InvalidDataError:
            return False
        for frame in frames:
            decoded += 1
            if frame.pts in wanted_pts:
                found[frame.pts] = to_upright_rgb(frame, label)
            if len(found) == len(wanted_pts) or (frame.pts is not None and frame.pts > last):
                return True
        return False

    unsent.discard(packet.pts)
    done = take(packet)
    for packet in packets:
        if done or not unsent or packet.size == 0 or decoded > max_frames + MAX_REORDER:
            break
        unsent.discard(packet.pts)
        done = take(packet)
    if not done:
        take(None)  # every wanted packet sent, or the end of the stream: drain the pictures held back
    codec.flush_buffers()
    missing = sorted(wanted_pts - set(found))
    if missing:
        raise CorruptVideo(label, f"frames at timestamps {missing[:4]} never came out of the decoder; the "
                                  "stream is damaged or truncated")
    return found, decoded
