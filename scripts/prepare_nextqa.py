#!/usr/bin/env python
"""Download NExT-QA (lmms-lab/NExTQA on the Hugging Face hub) and lay it out for configs/nextqa.yaml.

Needs network access to huggingface.co (and, for gated mirrors, `huggingface-cli login`). Result:

    <out>/MC/*.parquet        the multiple-choice split: video, qid, type, question, a0..a4, answer
    <out>/NExTVideo/**.mp4    the clips, named <video>.mp4 (the adapter searches subfolders)

Usage:  python scripts/prepare_nextqa.py data/nextqa [--split MC] [--skip-videos]
Then:   batchjob validate configs/nextqa.yaml
"""
from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from pathlib import Path


def extract_zips(src: Path, dest: Path) -> int:
    """Unpack every zip under `src` into `dest` (the hub ships the clips as zip archives)."""
    n = 0
    for z in sorted(src.rglob("*.zip")):
        print(f"extracting {z.name} ...", flush=True)
        with zipfile.ZipFile(z) as zf:
            zf.extractall(dest)
        n += 1
    return n


def check_layout(out: Path) -> int:
    """How many of the split's clips exist; prints a summary and returns the number missing."""
    import pyarrow.parquet as pq

    shards = sorted((out / "MC").glob("*.parquet"))
    videos = {p.stem for p in (out / "NExTVideo").rglob("*.mp4")}
    wanted = {str(v) for s in shards for v in pq.read_table(s, columns=["video"]).column("video").to_pylist()}
    missing = wanted - videos
    print(f"{len(shards)} parquet shard(s), {len(wanted)} clips referenced, {len(videos)} clips on disk, "
          f"{len(missing)} missing")
    return len(missing)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="dataset directory (configs/nextqa.yaml expects data/nextqa)")
    ap.add_argument("--repo", default="lmms-lab/NExTQA")
    ap.add_argument("--split", default="MC", help="hub folder of the multiple-choice split")
    ap.add_argument("--skip-videos", action="store_true", help="annotations only")
    args = ap.parse_args()
    from huggingface_hub import snapshot_download

    hub = args.out / ".hub"
    patterns = [f"{args.split}/*"] + ([] if args.skip_videos else ["*.zip", "**/*.zip"])
    snapshot_download(args.repo, repo_type="dataset", local_dir=hub, allow_patterns=patterns)
    (args.out / "MC").mkdir(parents=True, exist_ok=True)
    for shard in sorted((hub / args.split).glob("*.parquet")):
        shutil.copy2(shard, args.out / "MC" / shard.name)
    if not args.skip_videos:
        (args.out / "NExTVideo").mkdir(exist_ok=True)
        if not extract_zips(hub, args.out / "NExTVideo"):
            print("warning: no video archives found in the hub snapshot", file=sys.stderr)
    return 1 if check_layout(args.out) and not args.skip_videos else 0


if __name__ == "__main__":
    sys.exit(main())
