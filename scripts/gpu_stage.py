#!/usr/bin/env python3
"""Stage the packages `batchjob run` needs on the GPU machine that its image lacks, as one small archive.

The device machine has no network and carries at most 64 MiB of working tree per call; its image already
holds numpy, pyarrow, pyyaml, typer, rich, opencv-python-headless, transformers, torch and Ray's own
small dependencies (click, filelock, msgpack, packaging, protobuf, requests, attrs), but not Ray, PyAV,
pydantic, cronsim or jsonschema (which `import ray` needs). MLX's CUDA build travels separately
(`.gpu/whl/site.tar.xz`, docs/gpu_run.md).

Steps: download the wheels (no dependencies resolved: the list below is checked against each wheel's
Requires-Dist and the image's package list), install them into a scratch target, drop what a local Ray
with actors never loads (Java jars, the dashboard's web front end, Ray's libraries for training, tuning,
serving, data, LLMs and RL, tests, type stubs, Cython headers), strip the native binaries, replace the native
libraries the GPU machine never calls with stubs (`STUBBED_LIBS`), and pack `<out>/site.tar.xz`. It prints the
archive's size beside the other archives under `.gpu/` and the checkout, against the 64 MiB a call may carry.

    python3 scripts/gpu_stage.py                          # cp312 for the GPU machine -> .gpu/pipeline
    python3 scripts/gpu_stage.py --what mlx               # MLX CUDA (sm_90 only) + mlx-vlm -> .gpu/whl
    python3 scripts/gpu_stage.py --python-version 3.11 --out /tmp/stage311 --keep-site   # local check
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20

# The versions the development environments test with (inside pyproject.toml's ranges). Ray's own runtime
# needs that the image lacks: jsonschema and its three dependencies. typing-extensions travels too, since
# pydantic-core needs a recent one; threadpoolctl keeps the decoders' resize on one BLAS thread.
WHEELS = (
    "ray==2.60.0", "av==18.1.0", "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "typing-extensions==4.16.0", "cronsim==2.8", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1", "threadpoolctl==3.8.0",
)

# Ray subpackages a local cluster with tasks and actors never imports (checked with an import trace of
# ray.init + actors + ray.wait + ray.kill across the driver, workers and Ray's own agents).
RAY_UNUSED = ("jars", "rllib", "tune", "train", "serve", "data", "llm", "workflow", "dashboard/client",
              "util/spark", "util/dask", "util/joblib", "util/collective", "util/multiprocessing")
# pip matches manylinux tags exactly: MLX's Linux wheels exist only as manylinux_2_35.
PLATFORMS = ("--platform", "manylinux_2_35_x86_64", "--platform", "manylinux_2_28_x86_64",
             "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")
# MLX's CUDA build and the model definitions: the second archive (`.gpu/whl`), its libmlx.so cut to one GPU
# architecture by shared/tools/slim_mlx_cuda.py (the wheel carries cubins for six).
MLX_WHEELS = ("mlx==0.32.4", "mlx-cuda-13==0.32.4", "mlx-vlm==0.7.10")
SLIM_TOOL = ROOT.parent / "shared" / "tools" / "slim_mlx_cuda.py"
# mlx-vlm ships a package per model family (hundreds); the engine imports only the families it runs (plus the
# shared modules beside them), so the others stay behind: the room lets the pipeline's archive and MLX's travel
# in one call with the checkout.
MLX_VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
DROP_SUFFIXES = (".pyi", ".pxd", ".pyx", ".pyc", ".h", ".hpp", ".cpp", ".c", ".cu", ".java")
# Native libraries the GPU machine never calls, replaced by a stub of the same name and symbols so that PyAV
# still loads: SVT-AV1 is an AV1 *encoder*; only the CPU tests' synthetic AV1 clips use it, the benchmarks
# encode H.264 and HEVC. Its room is what lets both archives travel with the checkout in one call.
STUBBED_LIBS = ("libSvtAv1Enc",)


def download(wheels_dir: Path, python_version: str, wanted: tuple[str, ...] = WHEELS) -> list[Path]:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           *PLATFORMS, "-d", str(wheels_dir), *wanted]
    subprocess.run(cmd, check=True)
    tag = "cp" + python_version.replace(".", "")
    wheels = sorted(p for p in wheels_dir.glob("*.whl")
                    if "-none-" in p.name or "-abi3-" in p.name or f"-{tag}-" in p.name)
    names = {p.name.split("-")[0].lower().replace("_", "-") for p in wheels}
    missing = [w.split("==")[0] for w in wanted if w.split("==")[0].lower().replace("_", "-") not in names]
    if missing:
        sys.exit(f"gpu_stage: no wheel for {missing} in {wheels_dir}")
    return wheels


def install(wheels: list[Path], site: Path, python_version: str) -> None:
    if site.exists():
        shutil.rmtree(site)
    # --python-version/--platform let pip unpack wheels made for another Python than the one running it.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                    *PLATFORMS, "--target", str(site), *map(str, wheels)], check=True)


def slim_mlx(site: Path, sm: int) -> None:
    """Keep one GPU architecture's cubins in libmlx.so (the rest of the fat binary zeroed), then strip it."""
    if not SLIM_TOOL.is_file():
        sys.exit(f"gpu_stage: {SLIM_TOOL} not found (the shared tools folder beside the checkout)")
    lib = site / "mlx" / "lib" / "libmlx.so"
    tmp = lib.with_name("libmlx.slim.so")
    subprocess.run([sys.executable, str(SLIM_TOOL), str(lib), str(tmp), str(sm)], check=True)
    tmp.replace(lib)


def drop_other_families(site: Path, keep: tuple[str, ...] = MLX_VLM_FAMILIES) -> None:
    """Remove mlx-vlm's model packages other than `keep` (its modules directly under models/ stay)."""
    models = site / "mlx_vlm" / "models"
    for family in (p for p in models.iterdir() if p.is_dir()):
        if family.name not in keep and family.name != "__pycache__":
            shutil.rmtree(family)


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def slim(site: Path, keep_headers: bool = False) -> None:
    """Drop what never runs; `keep_headers` for MLX, whose CUDA backend compiles kernels at run time against
    the headers it ships (include/cccl)."""
    drop = tuple(s for s in DROP_SUFFIXES if not keep_headers or s not in (".h", ".hpp", ".cuh", ".cu"))
    for sub in RAY_UNUSED:
        shutil.rmtree(site / "ray" / sub, ignore_errors=True)
    shutil.rmtree(site / "bin", ignore_errors=True)   # console scripts: we call python -m
    for path in sorted(site.rglob("*"), reverse=True):   # children before their folders
        if path.is_dir():
            if path.name in ("tests", "__pycache__") or (path.name == "test" and path.parent.name != "site"):
                shutil.rmtree(path, ignore_errors=True)
            continue
        if path.suffix in drop or path.name in ("RECORD", "INSTALLER", "REQUESTED"):
            path.unlink()
        elif not path.is_symlink() and is_elf(path):
            subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)


def stub_unused_libraries(site: Path, prefixes: tuple[str, ...] = STUBBED_LIBS) -> list[str]:
    """Replace each library named by `prefixes` with a stub exporting the same symbols (each returns -1, an
    error code to its caller) under the same soname, so the libraries that link it still load; returns what
    was replaced (nothing where no C compiler is at hand: the real library stays)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    replaced = []
    for lib in sorted(p for p in site.rglob("*.so*") if p.name.startswith(prefixes) and not p.is_symlink()):
        if cc is None:
            print(f"gpu_stage: no C compiler, {lib.name} stays as it is")
            continue
        nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
        symbols = sorted({line.split()[-1] for line in nm.stdout.splitlines()
                          if len(line.split()) == 3 and line.split()[1] == "T"})
        source = lib.with_suffix(".stub.c")
        source.write_text("".join(f"int {name}(void) {{ return -1; }}\n" for name in symbols))
        subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{lib.name}", "-o", str(lib), str(source)],
                       check=True)
        source.unlink()
        replaced.append(f"{lib.name} ({len(symbols)} symbols)")
    return replaced


def carried_bytes(exclude: Path) -> tuple[int, list[tuple[Path, int]]]:
    """The checkout's tracked files plus every other archive under .gpu/ (what one call would carry)."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    tree = sum((ROOT / f).stat().st_size for f in files.decode().split("\0") if f and (ROOT / f).is_file())
    others = [(p, p.stat().st_size) for p in (ROOT / ".gpu").rglob("*.tar.xz") if p.resolve() != exclude.resolve()]
    return tree, others


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12)")
    ap.add_argument("--what", choices=("pipeline", "mlx"), default="pipeline",
                    help="pipeline: Ray, PyAV, pydantic... (.gpu/pipeline); mlx: MLX CUDA + mlx-vlm (.gpu/whl)")
    ap.add_argument("--sm", type=int, default=90, help="with --what mlx: the GPU architecture kept (90 = H100/H200)")
    ap.add_argument("--out", type=Path, default=None, help="folder for site.tar.xz (default .gpu/<pipeline|whl>)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-stage"), help="scratch folder (wheels, site)")
    ap.add_argument("--keep-site", action="store_true", help="leave the slimmed site in <work>/site-<py>")
    ap.add_argument("--site-only", action="store_true", help="stop after slimming (a local check of the site)")
    args = ap.parse_args()
    if not shutil.which("strip"):
        sys.exit("gpu_stage: `strip` (binutils) is needed to shrink the native libraries")
    tag = "cp" + args.python_version.replace(".", "")
    args.out = args.out or ROOT / ".gpu" / ("whl" if args.what == "mlx" else "pipeline")
    wanted = MLX_WHEELS if args.what == "mlx" else WHEELS
    wheels = download(args.work / f"wheels-{args.what}", args.python_version, wanted)
    site = args.work / f"site-{args.what}-{tag}"
    install(wheels, site, args.python_version)
    before = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    if args.what == "mlx":
        slim_mlx(site, args.sm)
        drop_other_families(site)
    slim(site, keep_headers=args.what == "mlx")
    for stub in stub_unused_libraries(site):
        print(f"  stubbed {stub}")
    after = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    if args.site_only:
        print(f"{len(wheels)} wheels for {tag}: installed {before / 2**20:.0f} MiB, slimmed {after / 2**20:.0f} MiB "
              f"in {site}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    archive = args.out / "site.tar.xz"
    tmp = archive.with_suffix(".tmp")
    env = {**os.environ, "XZ_OPT": "-9 -T0"}
    subprocess.run(["tar", "cJf", str(tmp), "-C", str(site), "."], check=True, env=env)
    tmp.rename(archive)
    size = archive.stat().st_size
    print(f"{len(wheels)} wheels for {tag}: installed {before / 2**20:.0f} MiB, slimmed {after / 2**20:.0f} MiB, "
          f"{archive} {size / 2**20:.1f} MiB")
    tree, others = carried_bytes(archive)
    total = tree + size + sum(s for _, s in others)
    for p, s in others:
        print(f"  also under .gpu/: {p.relative_to(ROOT)} {s / 2**20:.1f} MiB")
    print(f"  checkout {tree / 2**20:.1f} MiB; one call carrying all of it: {total / 2**20:.1f} MiB of "
          f"{CALL_LIMIT / 2**20:.0f} MiB ({'fits' if total <= CALL_LIMIT else 'DOES NOT FIT: split the calls'})")
    if not args.keep_site:
        shutil.rmtree(site)
    with tarfile.open(archive) as t:   # a truncated archive fails here, not on the GPU machine
        count = sum(1 for _ in t)
    print(f"  {count} entries readable")


if __name__ == "__main__":
    main()
