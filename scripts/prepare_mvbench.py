#!/usr/bin/env python
"""Download MVBench (OpenGVLab/MVBench on the Hugging Face hub) and lay it out for configs/mvbench.yaml.

Needs network access to huggingface.co; the dataset is gated, so accept its terms on the hub page and
`huggingface-cli login` first. Result:

    <out>/json/<subtask>.json   one list of {video, question, candidates, answer} per subtask
    <out>/video/<source>/...    the clips, unpacked from the hub's zip archives; configs/mvbench.yaml's
                                dataset.options.video_dirs maps each subtask to its folder here

Usage:  python scripts/prepare_mvbench.py data/mvbench [--keep-zips]
Then:   batchjob validate configs/mvbench.yaml
"""
from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path


def unpack(video: Path, keep: bool) -> None:
    for z in sorted(video.rglob("*.zip")):
        print(f"extracting {z.relative_to(video)} ...", flush=True)
        with zipfile.ZipFile(z) as zf:
            zf.extractall(z.parent)
        if not keep:
            z.unlink()


def check_layout(out: Path, video_dirs: dict[str, str]) -> int:
    """Per subtask: questions and clips found; returns the number of missing clips."""
    missing_total = 0
    for f in sorted((out / "json").glob("*.json")):
        items = json.loads(f.read_text())
        folder = out / "video" / video_dirs.get(f.stem, f.stem)
        missing = sum(1 for it in items if not (folder / it["video"]).exists())
        missing_total += missing
        print(f"{f.stem:28s} {len(items):5d} questions  {missing:5d} clips missing  ({folder})")
    return missing_total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="dataset directory (configs/mvbench.yaml expects data/mvbench)")
    ap.add_argument("--repo", default="OpenGVLab/MVBench")
    ap.add_argument("--keep-zips", action="store_true")
    ap.add_argument("--config", type=Path, default=Path(__file__).resolve().parents[1] / "configs/mvbench.yaml",
                    help="job config whose dataset.options.video_dirs is checked")
    args = ap.parse_args()
    import yaml
    from huggingface_hub import snapshot_download

    snapshot_download(args.repo, repo_type="dataset", local_dir=args.out, allow_patterns=["json/*", "video/*"])
    unpack(args.out / "video", args.keep_zips)
    video_dirs = yaml.safe_load(args.config.read_text())["dataset"].get("options", {}).get("video_dirs", {})
    return 1 if check_layout(args.out, video_dirs) else 0


if __name__ == "__main__":
    sys.exit(main())
