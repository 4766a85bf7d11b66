"""A real-benchmark run without the real data: write a POPE copy in the layout lmms-lab publishes (Hugging Face
parquet shards, the image embedded as the datasets Image struct) from demo-task images and their "is there a
..." questions, then evaluate it with the same loader a user's local POPE copy goes through.

    python benchmarks/fixture_benchmark.py --out runs/pope-fixture --n 300
    trimvlm eval --model demo --task pope --data runs/pope-fixture --recipe tokens=density:keep=0.25:layer=2 \
        --recipe tokens=fastv:keep=0.25:layer=2 --batch-size 50

The demo model was never taught POPE's instruction ("Answer the question using a single word or phrase."),
so its accuracy here measures that gap too; the point is the path (layout, prompt, metric: accuracy, F1,
predicted yes %), identical for a real copy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trimvlm.testing.benchmark_copies import pope_rows, write_shards


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke test in seconds: 12 rows, one shard")
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.shards = 12, 1
    write_shards(a.out, "test", pope_rows(a.n), shards=a.shards)
    print(f"wrote {a.n} POPE rows to {a.out}")


if __name__ == "__main__":
    main()
