"""On the GPU: a kept tail does not hold its clip's matrix (VideoFeatureCache.release_clip)."""
import gc
import mlx.core as mx
import numpy as np
from batchjob.engine.video_features import VideoFeatureCache
mx.set_default_device(mx.gpu)
gc.collect(); mx.clear_cache()
base = mx.get_active_memory()
cache = VideoFeatureCache(block_size=16)
f = mx.random.normal((6272 // 4, 4096 * 4)).astype(mx.bfloat16)   # one Qwen3-VL clip's features, 51 MB
mx.eval(f)
want = np.array(f[-9:].astype(mx.float32))
cache.put_clip("a", f)
del f
cache.release_clip("a", 6272 // 4 - 9, keep_tail=True)
t = cache.get("a", 6272 // 4 - 9, 6272 // 4)
ok = bool((np.array(t.slice(6272 // 4 - 9, 6272 // 4).astype(mx.float32)) == want).all())
gc.collect()
held = mx.get_active_memory() - base
print(f"tail check on {mx.default_device()}: values equal {ok}, held {held} bytes (the matrix was 51 MB)")
assert ok and held < 1 << 20
