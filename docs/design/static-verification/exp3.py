import os, sys
exec(open("/tmp/exp40/exp.py").read().split("from torch._dynamo.utils import counters")[0])
from torch._dynamo.utils import counters
import random
prompts = [[random.Random(i).randrange(512) for _ in range(20 + 7 * i)] for i in range(2)]
ok, s = spec_decode(prompts[:1], 10, lambda b, s: 0, 0.0)
print("FREEZE", FREEZE, "first cache", ok, dict(counters["stats"]))
ok, s = spec_decode(prompts[1:2], 10, lambda b, s: 0, 0.0)
print("FREEZE", FREEZE, "second cache object, same shape", ok, dict(counters["stats"]))
