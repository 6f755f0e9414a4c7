"""What the side channel's msgpack pre-scan costs beside the decode it guards, measured side by side.

    python bench/msgpack_prescan.py

A grant-shaped message (``{"type", "request", "block_ids"}``) of 256, 4,096 and 65,536 block ids, with ids of one
integer width (sorted, or all uint16) and of mixed widths; for each, the best of 5 runs of
:func:`kvlifecycle.untrusted.check_msgpack` and of ``msgspec.msgpack.decode``, and their ratio.
"""

from __future__ import annotations

import random
import timeit

import msgspec

from kvlifecycle.untrusted import check_msgpack


def main() -> None:
    rng = random.Random(1)
    print(f"{'ids':>6} {'widths':8} {'bytes':>7}  {'pre-scan us':>11}  {'decode us':>9}  ratio")
    for n in (256, 4096, 65536):
        for kind, high in (("sorted", 0), ("u16", 65536), ("mixed", 70000), ("u16/u32", 200000)):
            ids = list(range(1000, 1000 + n)) if kind == "sorted" else [rng.randrange(0, high) for _ in range(n)]
            raw = msgspec.msgpack.encode({"type": "GrantReply", "request": "r", "block_ids": ids})
            reps = max(3, 20000 // n)
            scan = min(timeit.repeat(lambda raw=raw: check_msgpack(raw), number=reps, repeat=5)) / reps
            decode = min(timeit.repeat(lambda raw=raw: msgspec.msgpack.decode(raw), number=reps, repeat=5)) / reps
            print(f"{n:6d} {kind:8s} {len(raw):7d}  {scan * 1e6:11.1f}  {decode * 1e6:9.1f}  {scan / decode:5.2f}")


if __name__ == "__main__":
    main()
