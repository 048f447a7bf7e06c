"""One rule for where batchjob's caches live (`batchjob.cache_home`): `$BATCHJOB_CACHE`, else
`$XDG_CACHE_HOME/batchjob`, else `~/.cache/batchjob`; the demo's assets and the compiled kernels follow it."""
from __future__ import annotations

from pathlib import Path

from batchjob.cache_home import cache_home
from batchjob.demo import demo_dir
from batchjob.engine.kernel_cache import kernel_cache_root


def test_the_setting_wins_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_home({}) == tmp_path / "home" / ".cache" / "batchjob"
    assert cache_home({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "batchjob"
    both = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "BATCHJOB_CACHE": str(tmp_path / "mine")}
    assert cache_home(both) == tmp_path / "mine"
    assert cache_home({"BATCHJOB_CACHE": "~/shared"}) == tmp_path / "home" / "shared"   # ~ expanded
    assert cache_home({"BATCHJOB_CACHE": "", "XDG_CACHE_HOME": ""}) == tmp_path / "home" / ".cache" / "batchjob"


def test_every_cache_moves_with_the_one_setting(tmp_path, monkeypatch):
    for env in ({"XDG_CACHE_HOME": tmp_path / "xdg"}, {"BATCHJOB_CACHE": tmp_path / "mine"}):
        monkeypatch.delenv("BATCHJOB_CACHE", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        root = cache_home()
        assert demo_dir() == (root / "demo").resolve()
        assert kernel_cache_root() == root / "mlx-cuda-kernels"
        assert Path(demo_dir(tmp_path / "given")) == (tmp_path / "given" / "demo").resolve()   # --cache still wins
