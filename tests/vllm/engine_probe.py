"""Answers a saved set of clips with one engine, in a process of its own (as the pipeline's engine actor
would): `python engine_probe.py {mlx,vllm,transformers} CHECKPOINT CLIPS_DIR`. Writes CLIPS_DIR/KIND.json.

Each engine gets a fresh process because mlx-vlm, once imported, changes what transformers' video
processor makes in that process; the pipeline never mixes them either.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from batchjob.config import ModelConfig, PromptConfig, VllmConfig
from batchjob.contract import ClipJob, ClipMetadata, EngineClip, Question


def load_clips(directory: Path) -> list[EngineClip]:
    spec = json.loads((directory / "clips.json").read_text())
    frames = np.load(directory / "frames.npz")
    return [EngineClip(ClipJob(c["video"], c["media_id"], tuple(Question(q[0], q[1], tuple(q[2])) for q in c["questions"])),
                       ClipMetadata(**{**c["metadata"], "frames_indices": tuple(c["metadata"]["frames_indices"])}),
                       frames[c["media_id"]]) for c in spec]


def save_clips(directory: Path, clips: list[EngineClip]) -> None:
    spec = [{"video": c.job.video, "media_id": c.job.media_id,
             "questions": [[q.row_id, q.text, list(q.options)] for q in c.job.questions],
             "metadata": {k: v for k, v in c.metadata.standard().items()}} for c in clips]
    (directory / "clips.json").write_text(json.dumps(spec))
    np.savez(directory / "frames.npz", **{c.job.media_id: c.payload for c in clips})


def transformers_answers(checkpoint: str, clips: list[EngineClip]) -> dict:
    """One request at a time: transformers' video processor (torchvision) and the model's own forward."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.video_utils import VideoMetadata

    from batchjob.engine.prompt import PromptBuilder
    from batchjob.pipeline.mlx_engine import engine_config

    torch.set_grad_enabled(False)
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    video_id = model.config.video_token_id
    prompts = PromptBuilder(processor.tokenizer, engine_config(ModelConfig(checkpoint=checkpoint), PromptConfig()),
                            video_id, checkpoint)
    vp = processor.video_processor
    out = {}
    for clip in clips:
        m = clip.metadata
        vmeta = VideoMetadata(total_num_frames=m.total_num_frames, fps=m.fps, frames_indices=list(m.frames_indices))
        video = vp(videos=[clip.payload], video_metadata=[vmeta], do_sample_frames=False, return_tensors="pt")
        grid = torch.as_tensor(np.asarray(video["video_grid_thw"]))
        pixels = torch.as_tensor(np.asarray(video["pixel_values_videos"]), dtype=torch.float32)
        spg = vp.temporal_patch_size / vmeta.sampled_fps   # transformers' own temporal step
        for q in clip.job.questions:
            ids = torch.tensor([prompts.token_ids(q.text, q.options, int(grid.prod()) // vp.merge_size ** 2).tolist()])
            logits = model(input_ids=ids, pixel_values_videos=pixels, video_grid_thw=grid,
                           second_per_grid_ts=torch.tensor([spg]),
                           mm_token_type_ids=(ids == video_id).to(torch.int32) * 2).logits[0, -1].double()
            probs = torch.softmax(logits[prompts.option_token_ids(len(q.options))], 0).tolist()
            out[q.row_id] = {"probs": probs, "prompt_tokens": int(ids.shape[1]), "cached_tokens": 0, "error": None}
    return out


def main(kind: str, checkpoint: str, directory: str) -> None:
    clips = load_clips(Path(directory))
    if kind == "transformers":
        out = transformers_answers(checkpoint, clips)
    else:
        if kind == "mlx":
            from batchjob.pipeline.mlx_engine import MlxEngine as engine_cls
            model = ModelConfig(checkpoint=checkpoint, dtype="float32", max_model_len=4096, memory_budget_gb=1.0)
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            from batchjob.pipeline.vllm_engine import VllmEngine as engine_cls
            model = ModelConfig(checkpoint=checkpoint, engine="vllm", dtype="float32",
                                vllm=VllmConfig(max_model_len=4096, enforce_eager=True))
        engine = engine_cls.load(model, PromptConfig())
        out = {a.row_id: {"probs": list(a.probs), "prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens,
                          "error": a.error} for a in engine.answer(clips)}
    (Path(directory) / f"{kind}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
