"""`Classifier`: multiple-choice questions about video clips, answered by one prefill per question.

The answer is the option label whose token has the highest logit at the prompt's last position; the
probabilities are a softmax over the option labels' logits only (the model's preference among the offered
answers, not its probability of emitting that token among the whole vocabulary).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Callable
from typing import Sequence as Seq

import mlx.core as mx
import numpy as np

from batchjob.metal_backend import BlockPool, KVCache, kv_bytes_per_block, paged_attention, select_attention_backend
from batchjob.metal_backend.selection import gpu_portable_attention

from batchjob.startup import StepClock

from .attention import decoder_heads, install_paged_attention, qk_norm_heads
from .checkpoint import LoadedCheckpoint, load_checkpoint
from .cuda_attention import select_hopper_attention
from .cuda_fused import activate as activate_fused_kernels
from .cuda_fused import select_fused_kernels
from .device import EngineRuntime, dtype_name
from .intake import CallIntake
from .memory_budget import MemoryBudgetError, MemoryPlan, plan_memory, read_device_memory
from .patchify import upload_bytes
from .preprocess import VideoPlan, check_frames, check_prepared, plan_video, preprocess_video
from .prompt import PromptBuilder
from . import runner
from .runner import forward
from .scheduler import Scheduler, Sequence
from .staging import StagingArea
from .token_budget import (activation_bytes_per_token, auto_batched_tokens, language_model_shape,
                           reused_bytes_per_token)
from .types import ClassifyRequest, ClassifyResult, EngineConfig, EngineError
from .video_features import FeatureRows, VideoFeatureCache, tail_first_row
from .vision_attention import rotary_heads

log = logging.getLogger(__name__)

# The KV pool holds this many maximum-size requests at most: prefill-only sequences leave as soon as their
# last token is computed, so more blocks only extend how long finished prefixes stay cached.
KV_REQUESTS_CAP = 4
# A step's pass is queued behind the one before it, whose logits are read only then (`runner.LayerQueue`): the step's
# end costs the device no wait on the host's reading, bookkeeping and scheduling. False: each pass is done and read
# before the next step is scheduled (kept for the A/B in scripts/diag_intake_ab.py).
OVERLAP_PASSES = True


def plan_engine_memory(checkpoint: LoadedCheckpoint, config: EngineConfig, num_layers: int, device_memory=None
                       ) -> tuple[MemoryPlan, int]:
    """The budget for this engine from the device it runs on (read after the weights are resident), the KV
    blocks it buys (the pool holds at most KV_REQUESTS_CAP maximum-size requests), and what
    `max_num_batched_tokens: auto` means there (token_budget.py: from the device's memory, or from
    `memory_budget_gb` where that is set lower); one forward's activations at that many tokens, and the vision
    features of one step started ahead of it (intake.py), are part of what the budget must hold."""
    lm = checkpoint.model.language_model
    kv_shape = checkpoint.family.kv_shape(lm)   # mlx-vlm's lm.head_dim is wrong for some Qwen3-VL
    dtype_bytes = mx.zeros((), dtype=checkpoint.dtype).itemsize
    if device_memory is None:
        mx.clear_cache()   # buffers freed while loading are still counted as used by the driver
        device_memory = read_device_memory(checkpoint.device)
    shape = language_model_shape(lm, kv_shape)
    per_token = activation_bytes_per_token(**shape, dtype_bytes=dtype_bytes, layer_lag=runner.LAYER_LAG)
    memory = device_memory.capacity_bytes
    if config.memory_budget_gb is not None:   # a budget set below the device sizes the forwards too
        memory = min(memory, int(config.memory_budget_gb * 2**30))
    auto_tokens = auto_batched_tokens(checkpoint.device, memory_bytes=memory,
                                      weights_bytes=checkpoint.weights_bytes, bytes_per_token=per_token,
                                      block_size=config.block_size)
    tokens = auto_tokens if config.max_num_batched_tokens == "auto" else int(config.max_num_batched_tokens)
    per_block = kv_bytes_per_block(num_layers=num_layers, num_kv_heads=kv_shape[0], head_dim=kv_shape[1],
                                   dtype_bytes=dtype_bytes, block_size=config.block_size)
    cap_tokens = KV_REQUESTS_CAP * max(config.max_model_len, tokens)
    features = lookahead_feature_bytes(shape["hidden"], checkpoint.family.num_deepstack, dtype_bytes)
    try:
        plan = plan_memory(device=device_memory, requested_gb=config.memory_budget_gb,
                           weights_bytes=checkpoint.weights_bytes, activation=tokens * (per_token + features),
                           kv_block_bytes=per_block, block_size=config.block_size,
                           blocks_per_request=-(-config.max_model_len // config.block_size),
                           max_blocks=-(-cap_tokens // config.block_size), host_reserved=config.host_reserved_bytes,
                           reused=tokens * reused_bytes_per_token(**shape, dtype_bytes=dtype_bytes))
    except MemoryBudgetError as exc:
        raise EngineError(str(exc)) from exc
    return plan, auto_tokens


def lookahead_feature_bytes(hidden: int, num_deepstack: int, dtype_bytes: int) -> int:
    """Bytes per token of the vision features a step's towers leave for the LM (the main set and each DeepStack
    set, at the LM's width): what the next step's towers, started ahead, hold meanwhile."""
    return hidden * (1 + num_deepstack) * dtype_bytes


def cap_buffer_cache(limit: int) -> int:
    """Lower MLX's limit on cached free buffers to `limit` (MemoryPlan.buffer_cache_bytes); a lower limit the
    process set already stays. Returns the limit in force."""
    previous = mx.set_cache_limit(limit)
    if previous < limit:
        mx.set_cache_limit(previous)
        return previous
    return limit


CUDA_REASON = "NVIDIA GPU: the portable path on cuDNN's fused SDPA"


def _select_cuda_attention(config: EngineConfig, checkpoint: LoadedCheckpoint) -> tuple[str, str, object]:
    """The Hopper paged kernel where it builds and passes its check (`cuda_attention`), else cuDNN's SDPA."""
    portable = gpu_portable_attention(checkpoint.dtype)
    heads = decoder_heads(checkpoint.model.language_model)
    fn, reason = select_hopper_attention(checkpoint.dtype, heads, config.block_size, portable)
    if fn is not None:
        return "cuda", reason, fn
    if config.attention_backend == "cuda":
        raise EngineError(f"EngineConfig.attention_backend='cuda' but the kernel is unusable here: {reason}; use "
                          "attention_backend='auto' to fall back to the portable path")
    return "portable", f"{CUDA_REASON} ({reason})", portable


def _select_attention(config: EngineConfig, checkpoint: LoadedCheckpoint) -> tuple[str, str, object]:
    """(name, reason, function): our kernels for the device when they pass the probe, else the portable path."""
    if config.attention_backend == "portable":
        fn = paged_attention if checkpoint.device == "cpu" else gpu_portable_attention(checkpoint.dtype)
        return "portable", "portable path requested (attention_backend='portable')", fn
    dtype = checkpoint.dtype
    if checkpoint.device == "cuda":
        return _select_cuda_attention(config, checkpoint)
    if config.attention_backend == "cuda":
        raise EngineError(f"EngineConfig.attention_backend='cuda' needs an NVIDIA Hopper GPU; this engine runs on "
                          f"{checkpoint.device}: use attention_backend='auto'")
    backend = select_attention_backend(probe=True, dtype=dtype)
    log.info("attention backend %s: %s", backend.name, backend.reason)
    wanted = config.attention_backend
    if wanted == "metal" and backend.name != wanted:
        raise EngineError(f"EngineConfig.attention_backend={wanted!r} but the kernels are unusable here: "
                          f"{backend.reason}; use attention_backend='auto' to fall back to the portable path")
    return backend.name, backend.reason, backend


class Classifier:
    """Prefill-only VLM classifier over a paged KV cache; see `from_pretrained`."""

    def __init__(self, checkpoint: LoadedCheckpoint, config: EngineConfig, clock: StepClock | None = None):
        clock = clock or StepClock()
        self.config = config
        self.checkpoint = checkpoint
        self.model_id = checkpoint.model_id
        self.prompts = PromptBuilder(checkpoint.tokenizer, config, checkpoint.video_token_id, str(checkpoint.path))
        self.attention_backend, reason, self._attention = _select_attention(config, checkpoint)
        self._device = mx.cpu if checkpoint.device == "cpu" else mx.gpu  # pinned: several engines may share a process
        lm = checkpoint.model.language_model
        num_layers = install_paged_attention(lm)
        self.fused_kernels = select_fused_kernels(checkpoint.device, checkpoint.dtype, qk_heads=qk_norm_heads(lm),
                                                  vision_heads=rotary_heads(checkpoint.model.vision_tower))
        activate_fused_kernels(self.fused_kernels)
        log.info("fused kernels: %s", self.fused_kernels.summary())
        self.runtime = EngineRuntime(checkpoint.device, dtype_name(checkpoint.dtype), self.attention_backend, reason,
                                     self.fused_kernels.summary())
        clock.mark("attention_select")
        kv_heads, head_dim = checkpoint.family.kv_shape(lm)   # mlx-vlm's lm.head_dim is wrong for some Qwen3-VL
        self.memory, self.auto_batched_tokens = plan_engine_memory(checkpoint, config, num_layers)
        self.buffer_cache_bytes = cap_buffer_cache(self.memory.buffer_cache_bytes)
        num_blocks = self.memory.kv_blocks
        log.info("memory budget %.1f GiB (%s): %d KV blocks, %d tokens per forward", self.memory.budget_bytes / 2**30,
                 self.memory.source, num_blocks, self.max_num_batched_tokens)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv_cache = KVCache(num_layers, num_blocks, config.block_size, kv_heads, head_dim, checkpoint.dtype)
        self._features = VideoFeatureCache(config.block_size)
        self._staging = StagingArea()
        self._prompt_lock = threading.Lock()   # the tokenizer, for `stage` on another thread
        # Called once a call's first pass is queued and its thread about to wait on the device: the moment for
        # another thread's `stage` (pipeline/driver_engine.py).
        self.on_device_busy: Callable[[], None] | None = None
        self.vision_calls = 0  # vision-tower runs (each encodes one clip); the sharing tests count them
        self._call_ids = itertools.count()
        clock.mark("kv_cache")
        self.startup = tuple(clock.steps)

    @property
    def max_num_batched_tokens(self) -> int:
        """Tokens per forward pass: the config's number, or what `auto` resolved to for this model and device."""
        value = self.config.max_num_batched_tokens
        return self.auto_batched_tokens if value == "auto" else int(value)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, config: EngineConfig | None = None,
                        clock: StepClock | None = None) -> "Classifier":
        """Load a checkpoint of a supported family (directory or hub id); EngineError on any load problem.
        `clock` gets a mark per load step (`startup` lists them)."""
        config = config or EngineConfig()
        config.validate()
        clock = clock or StepClock()
        return cls(load_checkpoint(model, config, clock), config, clock)

    # --- request preparation ---------------------------------------------------------------------------
    def _clip_plan(self, clip) -> VideoPlan:
        """The clip's grid and video token count; ValueError (a per-request error) for input the engine cannot use."""
        if clip.inputs is not None:
            check_prepared(clip.inputs, self.checkpoint.vision)
            return clip.inputs
        check_frames(clip.frames)
        return plan_video(clip.frames.shape, clip.metadata, self.checkpoint.vision)

    def _media_key(self, index: int, request: ClassifyRequest, call_id: int) -> str:
        """Whose features and prefix blocks a request shares: its clip's, or (sharing off) its own."""
        media_id = request.clip.media_id
        return media_id if self.config.enable_prefix_sharing else f"{media_id}#{call_id}:{index}"

    def _video_prompt(self, request: ClassifyRequest, plan: VideoPlan):
        with self._prompt_lock:
            return self.checkpoint.family.video_prompt(self.prompts, request.question, request.options, plan)

    def _prepare(self, index: int, request: ClassifyRequest, call_id: int) -> Sequence:
        plan = self._clip_plan(request.clip)
        prompt = None
        if request.clip.inputs is not None:
            prompt = self._staging.take_prompt(request.clip.inputs, request.question, request.options)
        if prompt is None:
            prompt = self._video_prompt(request, plan)
        ids = prompt.token_ids
        if len(ids) > self.config.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens ({plan.num_tokens} for the video), longer than max_model_len "
                f"{self.config.max_model_len}; use fewer frames or a lower max_pixels, or raise max_model_len")
        share = self.config.enable_prefix_sharing
        return Sequence(
            index=index, seq_id=f"{call_id}:{index}", media_key=self._media_key(index, request, call_id),
            token_ids=ids, positions=prompt.positions, video_span=prompt.video_span,
            option_token_ids=self.prompts.option_token_ids(len(request.options)), share_prefix=share,
            grid_thw=plan.grid_thw, video_rows=prompt.video_rows)

    @staticmethod
    def _read_answers(intake: CallIntake, requests: Seq[ClassifyRequest], batch: list, out: runner.ForwardOutput
                      ) -> None:
        """The answers of the requests whose last prompt token `out`'s pass computed (waits for the pass)."""
        for row, slot in enumerate(out.finished_slices):
            seq = batch[slot].seq
            intake.results[seq.index] = _result(requests[seq.index].request_id, seq, out.logits[row])

    def _video_rows(self, batch, requests: Seq[ClassifyRequest]) -> dict:
        """Vision features for every clip whose video tokens are computed in this step (tower runs if needed)."""
        rows = {}
        for item in batch:
            seq = item.seq
            lo, hi = seq.rows_between(seq.num_computed, seq.num_computed + item.num_new)
            if lo >= hi:
                continue
            found = self._features.get(seq.media_key, lo, hi)   # a clip encoded earlier in this call is there too
            if found is None:
                found = self._encode(seq.media_key, requests[seq.index].clip, seq.grid_thw)
            rows[seq.media_key] = found
        return rows

    def _encode(self, key: str, clip, grid_thw: tuple[int, int, int]) -> FeatureRows:
        """Run the vision tower over `clip` and keep its features under `key`; started at once (`mx.async_eval`),
        so the device runs the tower while Python goes on building graphs or preparing prompts (evaluated with
        the forward instead, the device would wait for all of that host work first)."""
        inputs = clip.inputs or preprocess_video(clip.frames, clip.metadata, self.checkpoint.vision)
        if inputs.grid_thw != grid_thw:
            raise RuntimeError(f"processor grid {inputs.grid_thw} != planned {grid_thw} for {clip.media_id}")
        uploaded = self._staging.take_upload(clip.inputs) if clip.inputs is not None else None
        features = self.checkpoint.encode_clip(inputs, uploaded)
        mx.async_eval(features)
        self.vision_calls += 1
        return self._features.put_clip(key, features)

    def stage(self, requests: Seq[ClassifyRequest]) -> None:
        """Do the host work of a later `classify(requests)` now, on the caller's thread: each clip's patch bytes
        uploaded (`patchify.upload_bytes`) and each request's prompt made. Safe beside a running call (MLX is
        only asked to make arrays from host data; the tokenizer is shared under a lock). Best effort: a request
        that fails here is left to the call, which reports it."""
        for request in requests:
            inputs = request.clip.inputs
            if inputs is None:
                continue
            try:
                plan = self._clip_plan(request.clip)
                if inputs.pixel_values.dtype == np.uint8 and not self._staging.has_upload(inputs):
                    self._staging.put_upload(inputs, upload_bytes(inputs.pixel_values))
                self._staging.put_prompt(inputs, request.question, request.options,
                                         self._video_prompt(request, plan))
            except Exception as err:   # the call meets it again and reports it as the request's error
                log.debug("staging %s: %s", request.request_id, err)

    # --- the loop ------------------------------------------------------------------------------------------
    def classify(self, requests: Seq[ClassifyRequest]) -> list[ClassifyResult]:
        """Answer every request; results come back in request order, failed requests as error results."""
        with mx.stream(self._device):
            return self._classify(requests)

    def _classify(self, requests: Seq[ClassifyRequest]) -> list[ClassifyResult]:
        """The steps' loop; the host's work for a step is done a step ahead, while the device runs the one before
        (intake.py)."""
        scheduler = Scheduler(self.pool, self.max_num_batched_tokens)
        intake = CallIntake.open(self, requests, admission_order(requests), next(self._call_ids), scheduler)
        layers = runner.LayerQueue() if OVERLAP_PASSES else None
        unread: tuple[list, runner.ForwardOutput] | None = None   # the pass queued last (and its batch), till read
        try:
            intake.start()
            while scheduler.has_work() or not intake.done:
                if not scheduler.has_work():   # every prompt admitted so far failed its preparation
                    intake.admit(scheduler.budget)
                    continue
                batch = scheduler.schedule(refill=intake.refill)
                ahead = intake.ahead(batch)
                out = forward(self.checkpoint.model, batch, self.kv_cache, self._attention,
                              self._video_rows(batch, requests), self.checkpoint.family.num_deepstack,
                              on_first_wait=self.on_device_busy, on_wait=ahead.piece,
                              on_queued=ahead.finish if layers is None else ahead.towers, layers=layers)
                if layers is None:
                    self._read_answers(intake, requests, batch, out)
                else:
                    if unread is not None:   # the pass before this one is done: its last layers ran before this
                        self._read_answers(intake, requests, *unread)   # pass's first, which the host waited for
                    unread = (batch, out)
                # the bookkeeping does not wait for the pass: the passes after it are queued behind it
                for seq in scheduler.finish_step(batch):
                    if intake.finished(seq.media_key):  # the clip is done: keep only what a later question needs
                        first = tail_first_row(seq.video_rows, seq.video_span, self.config.block_size)
                        self._features.release_clip(seq.media_key, first, keep_tail=seq.share_prefix)
            if unread is not None:
                self._read_answers(intake, requests, *unread)
        finally:
            scheduler.abort_all()
            intake.abandon()   # after an exception: drop what is left in flight (nothing, otherwise)
            self._staging.drop([r.clip.inputs for r in requests])
        return intake.results  # type: ignore[return-value]


def admission_order(requests: Seq[ClassifyRequest]) -> list[int]:
    """Request indices with the requests of one clip together, clips in first-appearance order (stable)."""
    first_seen: dict[str, int] = {}
    for i, r in enumerate(requests):
        first_seen.setdefault(r.clip.media_id, i)
    return sorted(range(len(requests)), key=lambda i: first_seen[requests[i].clip.media_id])


def _result(request_id: str, seq: Sequence, option_row: np.ndarray) -> ClassifyResult:
    """`option_row`: this request's option-token logits (fp32 from the device, padded past its options)."""
    option_logits = option_row[:len(seq.option_token_ids)].astype(np.float64)
    shifted = option_logits - option_logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    probs = np.exp(logprobs)
    return ClassifyResult(
        request_id=request_id, choice=int(np.argmax(option_logits)), probs=probs.tolist(),
        prompt_tokens=seq.num_tokens, cached_tokens=seq.num_cached, logprobs=logprobs.tolist())
