import sys, json
import mlx.core as mx
import numpy as np
sys.path.insert(0, "scripts")
from benchlib.timing import ms_per_call
out = {}
bf = mx.bfloat16
T, hkv, d, bs, nb, layers = 13896, 8, 128, 16, 8192, 6
ks = [mx.zeros((nb, bs, hkv, d), dtype=bf) for _ in range(layers)]
k = mx.random.normal((T, hkv, d)).astype(bf)
perm = np.random.default_rng(0).permutation(nb)[: (T + bs - 1) // bs]
slots_np = (perm[:, None] * bs + np.arange(bs)[None]).reshape(-1)[:T].astype(np.int32)
slots = mx.array(slots_np)
mx.eval(ks, k, slots)
width = hkv * d
for word, name in ((mx.uint32, "u32"), (mx.complex64, "c64"), (mx.int64, "i64"), (mx.float32, "f32")):
    it = iter(range(10**9))
    def write():
        i = next(it) % layers
        flat = ks[i].reshape(nb * bs, width).view(word)
        flat[slots] = k.reshape(T, width).view(word)
        ks[i] = flat.view(bf).reshape(nb, bs, hkv, d)
        return ks[i]
    try:
        out[name] = ms_per_call(write, inner=6, repeats=5)
        got = np.array(ks[0].reshape(nb * bs, width).view(mx.uint16))[slots_np]
        out[name + "_exact"] = bool((got == np.array(k.reshape(T, width).view(mx.uint16))).all())
    except Exception as e:
        out[name] = str(e)[:150]
    print(name, out[name], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
