"""Which SDPA calls one packed forward pass makes: sequences grouped into as few, as large calls as stay exact.

Why: on a GPU one `scaled_dot_product_attention` call has a fixed cost (launch, gathers, a cuDNN graph) that
dwarfs the arithmetic of a ~2,000-token sequence, so calling it once per sequence loses to one padded call
over the batch; padding everything, on the other hand, loses badly on ragged batches (a 30,000-token prompt
next to a 10-token one). The plan is pure host work on the metadata, built once per forward and shared by
every layer.

Exactness. MLX's `mask="causal"` is aligned lower-right: query row `j` of `q_len` rows over `k_len` keys sees
keys `< k_len - q_len + j + 1`. Sequences that share the number of cached tokens (`prefix`) therefore share
that offset, and a shorter one padded *at the end* to the group's longest query (and its keys to
`prefix + q_len`) is exact: a real row `j < l` sees keys `< prefix + j + 1 <= prefix + l`, never a padded
one. So groups are formed per prefix length and need no mask array. Padded rows repeat their sequence's last
real token (finite values) and are dropped from the output.

How much padding: a group is closed before its padded attention work exceeds `pad_slack` times the real work
(score entries a causal row sees: `q_len * prefix + q_len * (q_len + 1) / 2` per sequence). With the default
1.25 the worst case costs a quarter more attention arithmetic than per-sequence calls, while each call saved
is worth a fixed overhead: padding the attention of a ~2,000-token prompt by 25% costs well under 1% of its
layer's FLOPs (the projections and MLP dominate), much less than a per-call overhead of tenths of a
millisecond on an H100. Equal shapes never pad and always share a call (up to `group_rows`).

Followers of one clip (short questions over the same cached blocks) can instead be folded into ONE batch
element (`fold=True`, the GPU setting): their queries stacked on one axis, their keys the shared cached
positions gathered once followed by each one's own new positions, and a visibility mask that lets each query
see the shared prefix and its own sequence causally. A padded call gathers the shared prefix once per
follower; the folded one reads it once, for at most `FOLD_SLACK` times the real attention arithmetic. The folds
of different clips in one pass are stacked on SDPA's batch axis (`stack_folds`), padded within `PAD_SLACK`: one
call for the followers of many clips rather than one per clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PAD_SLACK = 1.25  # padded attention work per group <= PAD_SLACK x its real work (see the module docstring)
DECODE_SLACK = 1.25  # the same bound for one-token sequences, whose keys are padded and masked instead
FOLD_SLACK = 2.0  # a folded call's score entries <= FOLD_SLACK x its members' real work (it saves their gathers)
FOLD_MAX_Q = 128  # sequences with at most this many new tokens are folded (short questions over a clip)
GPU_SHAPE_BUCKETS = 8  # SDPA call lengths per power of two on CUDA (`bucketed`): at most 1/8 more rows or keys


def bucketed(n: int, per_octave: int) -> int:
    """`n` rounded up to one of `per_octave` (a power of two) evenly spaced lengths per octave; `n` when
    `per_octave` is 0.

    Why: CUDA's fused SDPA (cuDNN) builds a graph for every new shape, which costs far more than a call's
    arithmetic, and a job's calls rarely repeat a shape (questions differ by a few words, padded groups by a
    few rows). Rounded lengths repeat from call to call, for at most `1 / per_octave` more rows and keys."""
    if per_octave < 1 or n <= per_octave:
        return n
    step = 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())
    return -(-n // step) * step


@dataclass(frozen=True)
class SdpaCall:
    """One `scaled_dot_product_attention` over `n` sequences: queries `[n, Hq, q_len, D]`, keys `[n, Hkv, k_len, D]`.

    `q_tokens` gives the flat token of every query row (sequence-major); `out_tokens` the same with padded rows
    marked -1. When `q_start` is set the rows are exactly the flat tokens `[q_start, q_start + n * q_len)`, so
    the query is a view of `q`, not a copy. Keys are positions `[0, k_len)` of each sequence, positions past
    a sequence's context clamped to its last one (read, then masked or never seen). `key_tokens`, for
    sequences with nothing cached, names the flat new tokens those key positions are (so keys can come
    straight from this layer's fresh K/V); `k_start` is set when they are one contiguous run.
    """

    seqs: tuple[int, ...]
    q_len: int
    k_len: int
    q_tokens: np.ndarray  # int32 [n * q_len]
    out_tokens: np.ndarray  # int32 [n * q_len], -1 for padded rows
    q_start: int | None
    key_tokens: np.ndarray | None  # int32 [n * k_len] or None when any key is cached
    k_start: int | None
    mask: str | None  # "causal" (lower-right), "keys" (keys past each context masked), "visible" (the array
    # below), or None (all visible)
    key_slots: np.ndarray | None = None  # int32 [folds * k_len]: a folded call's keys as cache slots, per fold
    visible: np.ndarray | None = None  # bool [folds, q_len, k_len]: which keys each row of each fold sees
    folds: int = 0  # folded calls: how many folds (clips) are stacked on SDPA's batch axis

    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def batch(self) -> int:
        """SDPA's batch size: one per sequence, or one per fold for a folded call (a fold's sequences share its
        key axis)."""
        return self.folds if self.key_slots is not None else len(self.seqs)

    @property
    def padded_rows(self) -> int:
        return int(np.count_nonzero(self.out_tokens < 0))


@dataclass(frozen=True)
class AttentionPlan:
    """The calls of one forward pass and how their stacked output rows map back to the flat token order."""

    calls: tuple[SdpaCall, ...]
    inverse: np.ndarray | None  # int32 [num_tokens]: row of the stacked outputs holding token t; None = identity

    @property
    def num_calls(self) -> int:
        return len(self.calls)


def causal_work(q_len: int, prefix: int) -> float:
    """Score entries a causal query of `q_len` rows after `prefix` cached tokens sees."""
    return q_len * prefix + q_len * (q_len + 1) / 2


def padded_groups(lengths: Sequence[int], prefix: int, *, pad_slack: float, group_rows: int) -> list[list[int]]:
    """Partition sequences (given by index, all with `prefix` cached tokens) into groups padded to their
    longest query, each within `pad_slack` x its real work and `group_rows` query rows.

    Longest first, so a group's padding target is its first member and a member that does not fit closes the
    group (every later one is shorter still)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    real = 0.0
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            n = len(groups[-1]) + 1
            work = real + causal_work(lengths[i], prefix)
            if n * longest <= group_rows and n * causal_work(longest, prefix) <= pad_slack * work:
                groups[-1].append(i)
                real = work
                continue
        groups.append([i])
        real = causal_work(lengths[i], prefix)
    return groups


def decode_groups(context_lens: Sequence[int], slack: float = DECODE_SLACK) -> list[list[int]]:
    """Group one-token sequences (given by index) into batches whose padded keys stay within `slack`.

    Why: a one-token query is too small an op to run alone; batching many of them pads each to the group's
    longest context (masked), so groups are formed over sorted lengths and closed before padding exceeds
    `slack` times the real work. Cost thus still scales with the sum of context lengths.
    """
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * context_lens[groups[-1][0]] <= slack * (total + context_lens[i]):
            groups[-1].append(i)
            total += context_lens[i]
        else:
            groups.append([i])
            total = context_lens[i]
    return groups


def fold_groups(candidates: Sequence[int], q_lens: np.ndarray, prefix: np.ndarray, tables: np.ndarray,
                block_size: int, *, group_rows: int, slack: float = FOLD_SLACK) -> list[list[int]]:
    """Sequences (given by index, in batch order) whose cached full blocks are the same physical blocks,
    partitioned into folds of two or more: each within `slack` x its real work and `group_rows` rows."""
    by_blocks: dict[tuple, list[int]] = {}
    for s in candidates:
        full = int(prefix[s]) // block_size
        if full:
            by_blocks.setdefault(tuple(tables[s, :full].tolist()), []).append(int(s))
    folds = []
    for members in by_blocks.values():
        shared = int(prefix[members[0]]) // block_size * block_size
        current: list[int] = []
        for s in members:
            trial = current + [s]
            rows = sum(int(q_lens[m]) for m in trial)
            keys = shared + sum(int(prefix[m] + q_lens[m]) - shared for m in trial)
            real = sum(causal_work(int(q_lens[m]), int(prefix[m])) for m in trial)
            if len(trial) == 1 or (rows <= group_rows and rows * keys <= slack * real):
                current = trial
                continue
            folds.append(current)
            current = [s]
        folds.append(current)
    return [f for f in folds if len(f) >= 2]


def _fold_call(seqs: list[int], cu: np.ndarray, ctx: np.ndarray, prefix: np.ndarray, tables: np.ndarray,
               block_size: int) -> SdpaCall:
    """One batch element for followers sharing `shared` cached positions: their rows stacked; keys the shared
    positions (read once) then each one's own positions; row j of sequence s sees the shared keys and its own
    positions up to `prefix[s] + j`."""
    shared = int(prefix[seqs[0]]) // block_size * block_size

    def slots(s: int, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        return tables[s, pos // block_size] * block_size + pos % block_size

    q_tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs]).astype(np.int32)
    own = [slots(s, shared, int(ctx[s])) for s in seqs]
    key_slots = np.concatenate([slots(seqs[0], 0, shared)] + own).astype(np.int32)
    visible = np.zeros((len(q_tokens), len(key_slots)), dtype=bool)
    visible[:, :shared] = True
    row, col = 0, shared
    for s, mine in zip(seqs, own):
        q_len = int(cu[s + 1] - cu[s])
        positions = shared + np.arange(len(mine))   # own keys' positions in the sequence
        limit = int(prefix[s]) + np.arange(q_len)   # row j sees positions <= prefix + j
        visible[row:row + q_len, col:col + len(mine)] = positions[None, :] <= limit[:, None]
        row, col = row + q_len, col + len(mine)
    return SdpaCall(tuple(int(x) for x in seqs), len(q_tokens), len(key_slots), q_tokens, q_tokens.copy(),
                    _run_start(q_tokens, q_tokens),
                    None, None, "visible", key_slots, visible[None], 1)


def stack_folds(folds: list[SdpaCall], *, group_rows: int, slack: float = PAD_SLACK,
                buckets: int = 0) -> list[SdpaCall]:
    """Folds of different clips stacked on SDPA's batch axis, each padded to the stack's longest rows and keys:
    one call per stack instead of one per clip (a step holds the followers of many clips, and each call costs a
    fixed overhead). Largest first; a stack is closed before its padded work exceeds `slack` x its folds' own or
    its rows exceed `group_rows`. Padded rows repeat a fold's last token and see its first key only (finite
    values, dropped from the output); padded keys are seen by no row. `buckets`: rows and keys then padded to
    `bucketed` lengths, the same way."""
    order = sorted(folds, key=lambda c: (-c.q_len * c.k_len, c.seqs))
    stacks: list[list[SdpaCall]] = []
    for c in order:
        if stacks:
            trial = stacks[-1] + [c]
            q, k = max(f.q_len for f in trial), max(f.k_len for f in trial)
            if len(trial) * q <= group_rows and len(trial) * q * k <= slack * sum(f.q_len * f.k_len for f in trial):
                stacks[-1] = trial
                continue
        stacks.append([c])
    return [members[0] if len(members) == 1 and not buckets else _stacked(members, buckets) for members in stacks]


def _stacked(members: list[SdpaCall], buckets: int = 0) -> SdpaCall:
    q_len = bucketed(max(f.q_len for f in members), buckets)
    k_len = bucketed(max(f.k_len for f in members), buckets)
    q_tokens, out_tokens, key_slots = [], [], []
    visible = np.zeros((len(members), q_len, k_len), dtype=bool)
    for i, f in enumerate(members):
        pad_q, pad_k = q_len - f.q_len, k_len - f.k_len
        q_tokens.append(np.concatenate([f.q_tokens, np.repeat(f.q_tokens[-1:], pad_q)]))
        out_tokens.append(np.concatenate([f.out_tokens, np.full(pad_q, -1, dtype=np.int32)]))
        key_slots.append(np.concatenate([f.key_slots, np.repeat(f.key_slots[-1:], pad_k)]))
        visible[i, :f.q_len, :f.k_len] = f.visible[0]
        visible[i, f.q_len:, 0] = True
    q_tokens = np.concatenate(q_tokens).astype(np.int32)
    out_tokens = np.concatenate(out_tokens).astype(np.int32)
    return SdpaCall(tuple(s for f in members for s in f.seqs), q_len, k_len, q_tokens, out_tokens,
                    _run_start(q_tokens, out_tokens), None,
                    None, "visible", np.concatenate(key_slots).astype(np.int32), visible, len(members))


def _run_start(q_tokens: np.ndarray, out_tokens: np.ndarray) -> int | None:
    """The first token when a call's output rows are the flat tokens `[first, first + len)` in order (its query
    is then a view of q, not a gather), else None."""
    return int(q_tokens[0]) if np.array_equal(out_tokens, q_tokens[0] + np.arange(len(q_tokens))) else None


def _call(seqs, q_first, q_count, k_len: int, cu: np.ndarray, ctx: np.ndarray, prefix: np.ndarray,
          mask: str | None, buckets: int = 0) -> SdpaCall:
    """Rows `q_first[i] .. q_first[i] + q_count[i]` (flat tokens) of sequence `seqs[i]`, padded to the longest
    (then to its `bucketed` length, keys as many more: a causal call's offset stays), over key positions
    `[0, k_len)` of each sequence."""
    q_len = int(max(q_count))
    if mask == "causal":
        pad = bucketed(q_len, buckets) - q_len
        q_len, k_len = q_len + pad, k_len + pad
    steps = np.arange(q_len)
    q_tokens = np.concatenate([first + np.minimum(steps, count - 1) for first, count in zip(q_first, q_count)])
    out_tokens = np.concatenate([np.where(steps < count, first + steps, -1) for first, count in zip(q_first, q_count)])
    q_tokens, out_tokens = q_tokens.astype(np.int32), out_tokens.astype(np.int32)
    q_start = _run_start(q_tokens, out_tokens)
    key_tokens = k_start = None
    if all(prefix[s] == 0 for s in seqs):  # nothing cached: key position p of sequence s is its new token cu[s] + p
        keys = np.arange(k_len)
        key_tokens = np.concatenate([cu[s] + np.minimum(keys, ctx[s] - 1) for s in seqs]).astype(np.int32)
        if np.array_equal(key_tokens, key_tokens[0] + np.arange(len(key_tokens))):
            k_start = int(key_tokens[0])
    return SdpaCall(tuple(int(s) for s in seqs), q_len, int(k_len), q_tokens, out_tokens, q_start, key_tokens,
                    k_start, mask)


def plan_attention(cu_seqlens_q: np.ndarray, context_lens: np.ndarray, *, query_chunk: int, group_rows: int,
                   pad_slack: float = PAD_SLACK, block_tables: np.ndarray | None = None,
                   block_size: int = 0, buckets: int = 0) -> AttentionPlan:
    """The SDPA calls for a packed batch (host arrays of `AttentionMetadata`).

    - with `block_tables` (and `block_size`): followers with at most FOLD_MAX_Q new tokens whose cached full
      blocks are the same physical blocks are folded (`fold_groups`, `_fold_call`);
    - one-token sequences (two or more): `decode_groups`, keys padded to each group's longest context, masked;
    - sequences longer than `query_chunk` rows: alone, in chunks of rows, each against only the keys its last
      row can see (bounds the score matrix of unfused SDPA and skips the masked half of a fresh prompt);
    - the rest: grouped by cached prefix length and padded at the end (`padded_groups`), causal, no mask.
    `buckets` (`bucketed`): causal and folded calls padded further to lengths that repeat from pass to pass, so
    that CUDA's SDPA meets shapes it has built before; a padded call's query is then a gather, not a view.
    """
    if query_chunk < 1 or group_rows < 1 or pad_slack < 1:
        raise ValueError(f"plan_attention: query_chunk ({query_chunk}) and group_rows ({group_rows}) must be "
                         f">= 1 and pad_slack ({pad_slack}) >= 1")
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    q_lens = np.diff(cu)
    prefix = ctx - q_lens
    if len(q_lens) == 0 or np.any(q_lens < 1) or np.any(prefix < 0):
        raise ValueError(f"plan_attention: every sequence needs >= 1 new token and context >= its new tokens, got "
                         f"query lengths {q_lens.tolist()} and contexts {ctx.tolist()}")
    calls: list[SdpaCall] = []
    singles = np.flatnonzero(q_lens == 1)
    if len(singles) >= 2:
        for group in decode_groups(ctx[singles].tolist()):
            seqs = singles[group]
            k_len = int(ctx[seqs].max())
            mask = None if bool(np.all(ctx[seqs] == k_len)) else "keys"
            calls.append(_call(seqs, cu[seqs], [1] * len(seqs), k_len, cu, ctx, prefix, mask))
        rest = np.flatnonzero(q_lens > 1)
    else:
        rest = np.arange(len(q_lens))
    if block_tables is not None and block_size > 0:
        tables = np.asarray(block_tables)
        candidates = [int(s) for s in rest if q_lens[s] <= min(FOLD_MAX_Q, query_chunk)]
        folds = [_fold_call(fold, cu, ctx, prefix, tables, block_size)
                 for fold in fold_groups(candidates, q_lens, prefix, tables, block_size, group_rows=group_rows)]
        calls.extend(stack_folds(folds, group_rows=group_rows, buckets=buckets))
        folded = {s for c in calls if c.key_slots is not None for s in c.seqs}
        rest = np.array([s for s in rest if int(s) not in folded], dtype=np.int64)
    long = [int(s) for s in rest if q_lens[s] > query_chunk]
    for s in long:
        for a in range(int(cu[s]), int(cu[s + 1]), query_chunk):
            b = min(a + query_chunk, int(cu[s + 1]))
            visible = int(prefix[s]) + (b - int(cu[s]))
            calls.append(_call([s], [a], [b - a], visible, cu, ctx, prefix, "causal" if b - a > 1 else None,
                               buckets))
    short = [int(s) for s in rest if q_lens[s] <= query_chunk]
    for p in sorted({int(prefix[s]) for s in short}):
        members = [s for s in short if prefix[s] == p]
        for group in padded_groups([int(q_lens[s]) for s in members], p, pad_slack=pad_slack, group_rows=group_rows):
            seqs = np.array([members[i] for i in group])
            q_len = int(q_lens[seqs].max())
            calls.append(_call(seqs, cu[seqs], q_lens[seqs], p + q_len, cu, ctx, prefix,
                               "causal" if q_len > 1 else None, buckets))
    calls.sort(key=lambda c: int(c.out_tokens[c.out_tokens >= 0].min()))
    rows = np.concatenate([c.out_tokens for c in calls])
    num_tokens = int(cu[-1])
    if len(rows) == num_tokens and np.array_equal(rows, np.arange(num_tokens)):
        return AttentionPlan(tuple(calls), None)
    inverse = np.empty(num_tokens, dtype=np.int32)
    real = rows >= 0
    inverse[rows[real]] = np.flatnonzero(real)
    return AttentionPlan(tuple(calls), inverse)
