"""Hugging Face transformers on torch, the baseline users would otherwise run: one request at a time, a padded
batch, and the vision tower alone, on the same prepared inputs and prompts as the engine."""
from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np

from batchjob.engine.patchify import host_pixels

from .ceilings import median


def transformers_baseline(**kwargs) -> dict:
    """`_measure`, then its model freed and torch's cache emptied (the next model row needs the GPU)."""
    import torch

    result = _measure(**kwargs)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _measure(cfg_dir: Path, workload, token_ids, video_token_id: int, seq_requests: int, batch_size: int,
             batches: int, model_type: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu only under --smoke
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(cfg_dir)
    with torch.device(dev):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def inputs_for(reqs):
        ids = [token_ids(r) for r in reqs]
        longest = max(len(i) for i in ids)
        input_ids = torch.zeros((len(reqs), longest), dtype=torch.long)
        mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        for i, row in enumerate(ids):  # left padding: every prompt ends at the last column
            input_ids[i, longest - len(row):] = torch.tensor(row)
            mask[i, longest - len(row):] = 1
        pixels = torch.from_numpy(np.concatenate([host_pixels(r.clip.inputs) for r in reqs]))
        grids = torch.tensor([list(r.clip.inputs.grid_thw) for r in reqs])
        kwargs = dict(input_ids=input_ids.to(dev), attention_mask=mask.to(dev),
                      pixel_values_videos=pixels.to(dev).to(dtype), video_grid_thw=grids.to(dev),
                      mm_token_type_ids=((input_ids == video_token_id).to(torch.int32) * 2).to(dev), logits_to_keep=1)
        if model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor([r.clip.inputs.second_per_grid_t for r in reqs],
                                                        dtype=torch.float32).to(dev)
        return kwargs

    @torch.inference_mode()
    def run(reqs):
        out = model(**inputs_for(reqs)).logits[:, -1].float()
        sync()
        return out

    result = {}
    run(workload[:1])
    t0 = time.perf_counter()
    for r in workload[:seq_requests]:
        run([r])
    result["sequential_s_per_request"] = (time.perf_counter() - t0) / seq_requests
    result["sequential_requests"] = seq_requests
    try:
        run(workload[:batch_size])
        times = []
        for b in range(batches):
            t0 = time.perf_counter()
            run(workload[b * batch_size:(b + 1) * batch_size])
            times.append(time.perf_counter() - t0)
        result["batched_s_per_request"] = median(times) / batch_size
        result["batch_size"] = batch_size
    except torch.OutOfMemoryError as exc:
        result["batched_error"] = f"out of memory at batch {batch_size}: {exc}"[:300]
    visual = model.model.visual  # the vision tower alone, one clip
    r = workload[0]
    px = torch.from_numpy(host_pixels(r.clip.inputs)).to(dev).to(dtype)
    grid = torch.tensor([list(r.clip.inputs.grid_thw)]).to(dev)
    with torch.inference_mode():
        visual(px, grid_thw=grid)
        sync()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            visual(px, grid_thw=grid)
            sync()
            times.append(time.perf_counter() - t0)
    result["vision_ms_per_clip"] = median(times) * 1e3
    return result
