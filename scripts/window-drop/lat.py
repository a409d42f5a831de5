import glob, os, sys
OUT = os.environ.get('OUT', '/tmp/window-drop')
label = sys.argv[1]
s, e = [int(x) for x in open(f'{OUT}/{label}_window').read().split()]
rows = []
for f in glob.glob(f'{OUT}/{label}_log*'):
    for line in open(f):
        p = line.split()
        # client tx latency_us script epoch_s epoch_us
        end_ms = int(p[4]) * 1000 + int(p[5]) // 1000
        lat_ms = int(p[2]) / 1000
        rows.append((end_ms, lat_ms))
rows.sort()
def stats(name, lo, hi):
    xs = sorted(l for t, l in rows if lo <= t < hi)
    if not xs: print(name, 'none'); return
    p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    print(f"{name:28s} calls/s {len(xs) / ((hi - lo) / 1000):7.1f}  p50 {p(0.5):6.1f}  p99 {p(0.99):6.1f}  max {xs[-1]:7.1f} ms  over 100 ms: {sum(1 for x in xs if x > 100)}")
stats('before (10 s)', s - 10000, s)
stats('while it ran', s, e + 1)
stats('2 s from its start', s, s + 2000)
stats('after (10 s)', e + 1000, e + 11000)
print(f"the purge: {e - s} ms")
