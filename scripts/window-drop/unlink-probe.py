#!/usr/bin/env python3
"""What freeing a large file does to the fdatasync beside it (as a drop's unlink does to the
claims' WAL flushes): writes DIR/big-probe (1 GB by default), then times an 8 kB pwrite and
fdatasync in a loop while the file is unlinked at once, or with --steps truncated by 64 MB every
50 ms first. Usage: unlink-probe.py DIR [--steps] [--mb N]."""
import os, sys, threading, time

d = sys.argv[1]
steps = "--steps" in sys.argv
mb = int(sys.argv[sys.argv.index("--mb") + 1]) if "--mb" in sys.argv else 1024
big, probe = os.path.join(d, "big-probe"), os.path.join(d, "fsync-probe")
with open(big, "wb") as f:
    for _ in range(mb):
        f.write(os.urandom(1 << 20))
os.sync()
lat, stop = [], False

def writer():
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT)
    while not stop:
        t = time.time()
        os.pwrite(fd, b"x" * 8192, 0)
        os.fdatasync(fd)
        lat.append((t, time.time() - t))
    os.close(fd)

th = threading.Thread(target=writer)
th.start()
time.sleep(1)
t0 = time.time()
if steps:
    size = mb << 20
    while size > 0:
        size = max(0, size - (64 << 20))
        os.truncate(big, size)
        time.sleep(0.05)
os.unlink(big)
t1 = time.time()
time.sleep(1)
stop = True
th.join()
os.unlink(probe)
before = sorted(l for t, l in lat if t < t0)
during = sorted(l for t, l in lat if t0 <= t < t1 + 1)
p99 = lambda a: a[int(len(a) * 0.99)] * 1e3 if a else 0
print(f"freeing {mb} MB{' in steps' if steps else ''}: {(t1 - t0) * 1e3:.0f} ms; fdatasync "
      f"before p99 {p99(before):.2f} max {before[-1] * 1e3:.2f} ms; during and 1 s after p99 "
      f"{p99(during):.2f} max {during[-1] * 1e3:.2f} ms")
