import os, sys, time, resource
sys.argv = ["x"]
os.environ.setdefault("FREEZE", "1")
exec(open("/tmp/exp40/exp.py").read().split("from torch._dynamo.utils import counters")[0])
from torch._dynamo.utils import counters
import random
r0 = rss()
prompts = [[random.Random(i).randrange(512) for _ in range(20 + 7 * i)] for i in range(2)]
ok, s = spec_decode(prompts[:1], 10, lambda b, s: 0, 0.0)
print("first cache", ok, dict(counters["stats"]), f"rss +{rss()-r0:.0f}MiB")
ok, s = spec_decode(prompts[1:2], 10, lambda b, s: 0, 0.0)
print("second cache object, same shape", ok, dict(counters["stats"]), f"rss +{rss()-r0:.0f}MiB")
for k in [1, 3, 7, 15, 31, 63]:
    ok, s = spec_decode(prompts[:1], 5, lambda b, s: k, 0.5)
    print("bucket for k", k, ok, dict(counters["stats"]), f"rss +{rss()-r0:.0f}MiB")
