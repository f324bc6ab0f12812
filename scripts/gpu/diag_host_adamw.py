"""Host AdamW throughput on the GPU machine: torch's fused CPU AdamW in the main thread and in a worker thread, as
HostAdamW runs it (buckets, gradient copy, norm), with and without other threads waiting on CUDA events."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 450_000_000
BUCKET = 8_000_000


def timed(fn, reps=3):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def in_thread(fn):
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("t", (timed(fn), torch.get_num_threads())))
    th.start()
    th.join()
    return out["t"]


def main():
    print("env OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS"), "MKL", os.environ.get("MKL_NUM_THREADS"))
    print("torch threads main", torch.get_num_threads(), "interop", torch.get_num_interop_threads(), os.cpu_count())
    print(torch.__config__.parallel_info())
    nb = N // BUCKET
    flats = [torch.randn(BUCKET) for _ in range(nb)]
    grads = [torch.randn(BUCKET) for _ in range(nb)]
    srcs = [torch.randn(BUCKET, pin_memory=torch.cuda.is_available()) for _ in range(nb)]
    for f, g in zip(flats, grads):
        f.grad = g
    opts = [torch.optim.AdamW([f], lr=1e-3, weight_decay=0.01, fused=True) for f in flats]
    big = torch.randn(nb * BUCKET)
    big.grad = torch.randn_like(big)
    bigopt = torch.optim.AdamW([big], lr=1e-3, weight_decay=0.01, fused=True)
    n = nb * BUCKET / 1e9

    def buckets_step():
        for o in opts:
            o.step()

    def host_like():
        for f, o, s in zip(flats, opts, srcs):
            f.grad.copy_(s)
            float(torch.linalg.vector_norm(f.grad))
            o.step()

    def foreach_like():
        torch.optim.AdamW(flats, lr=1e-3, fused=True).step()

    rows = [
        ("fused, one flat, main", lambda: timed(bigopt.step)),
        ("fused, 8M buckets, main", lambda: timed(buckets_step)),
        ("fused, 8M buckets, worker thread", lambda: in_thread(buckets_step)[0]),
        ("copy+norm+fused buckets, main", lambda: timed(host_like)),
        ("copy+norm+fused buckets, worker", lambda: in_thread(host_like)[0]),
    ]
    for name, fn in rows:
        t = fn()
        print(f"{name:45s} {t * 1e3:8.1f} ms  {n / t:5.2f} Gparam/s", flush=True)
    print("worker thread sees threads:", in_thread(lambda: None)[1])
    if torch.cuda.is_available():
        stop = threading.Event()

        def spinner():  # a lane waiting on GPU work with a default (spinning) event
            x = torch.randn(4096, 4096, device="cuda")
            while not stop.is_set():
                for _ in range(20):
                    x = x @ x
                    x = x / x.norm()
                ev = torch.cuda.Event()
                ev.record()
                ev.synchronize()

        for k in (1, 3):
            stop.clear()
            ths = [threading.Thread(target=spinner) for _ in range(k)]
            for th in ths:
                th.start()
            time.sleep(0.5)
            t = in_thread(host_like)[0]
            stop.set()
            for th in ths:
                th.join()
            print(f"{'host-like worker, ' + str(k) + ' spinning lanes':45s} {t * 1e3:8.1f} ms  {n / t:5.2f} Gparam/s")
        for threads in (8, 12):
            torch.set_num_threads(threads)
            stop.clear()
            ths = [threading.Thread(target=spinner) for _ in range(3)]
            for th in ths:
                th.start()
            time.sleep(0.5)
            t = timed(host_like)
            stop.set()
            for th in ths:
                th.join()
            print(f"{'host-like main, 3 lanes, threads=' + str(threads):45s} {t * 1e3:8.1f} ms  {n / t:5.2f} Gparam/s")


if __name__ == "__main__":
    main()
