"""scripts/gpu_stage.py's library stub: a library replaced by it keeps its soname and symbols, so what links it
still loads, and its functions answer with an error instead of doing the work."""
from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CC = shutil.which("cc") or shutil.which("gcc")


def _gpu_stage():
    spec = importlib.util.spec_from_file_location("gpu_stage", ROOT / "scripts" / "gpu_stage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_stage"] = module
    spec.loader.exec_module(module)
    return module


def _build(cc: str, out: Path, source: str, *flags: str) -> None:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True)
    src.unlink()


@pytest.mark.skipif(CC is None, reason="needs a C compiler")
def test_a_stubbed_library_still_loads_under_its_linker_and_returns_errors(tmp_path, rng):
    names = [f"enc_{rng.randrange(10**6)}_{i}" for i in range(rng.randint(2, 6))]
    values = [rng.randint(1, 1000) for _ in names]
    libs = tmp_path / "pkg.libs"
    libs.mkdir()
    encoder = libs / "libEnc-1234abcd.so.4.1.0"
    _build(CC, encoder, "".join(f"int {n}(void) {{ return {v}; }}\n" for n, v in zip(names, values)),
           f"-Wl,-soname,{encoder.name}")
    user = libs / "libuser.so"        # links the encoder by soname, as libavcodec links SVT-AV1
    _build(CC, user, "".join(f"int {n}(void);\n" for n in names)
           + "int call(int i) {\n" + "".join(f"  if (i == {i}) return {n}();\n" for i, n in enumerate(names))
           + "  return 0;\n}\n", str(encoder), f"-Wl,-rpath,{libs}")
    other = libs / "libother.so.1"
    _build(CC, other, "int other(void) { return 5; }\n")
    before = ctypes.CDLL(str(user), mode=ctypes.RTLD_LOCAL)
    assert [before.call(i) for i in range(len(names))] == values

    replaced = _gpu_stage().stub_unused_libraries(tmp_path, prefixes=("libEnc",))

    assert replaced == [f"{encoder.name} ({len(names)} symbols)"]
    assert subprocess.run(["readelf", "-d", str(encoder)], capture_output=True, text=True,
                          check=True).stdout.count(f"[{encoder.name}]") == 1       # the soname kept
    assert not list(libs.glob("*.c")), "the stub's source is left behind"
    # A fresh process loads the user against the stub (this one has the real library mapped already).
    probe = (f"import ctypes; u = ctypes.CDLL({str(user)!r}); "
             f"print([u.call(i) for i in range({len(names)})]); print(ctypes.CDLL({str(other)!r}).other())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == str([-1] * len(names)), out
    assert out[1] == "5", "a library the prefixes do not name was changed"
